"""The grouped_mm MoE backend (kernels/moe_grouped.py) against the torch reference.

torch 2.13 runs torch._grouped_mm on CPU (a loop of mm, bf16 and fp32), so the CPU cases run this backend whole:
the real sort, gather, grouped_mm, the Triton LoRA delta passes, activation and top-k sum (interpreted). What they
cannot check is torch's CUTLASS grouped GEMM itself, which exists only on sm90/sm100 GPUs: the gpu1 test compares
the backend with the fused Triton kernel and the reference in bf16 at the real Qwen3-30B-A3B and gpt-oss-20b
expert shapes, and first asserts that the CUTLASS path is the one taken (not the fallback).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lpdiff.kernels import faults, moe_forward
from lpdiff.kernels import moe_grouped as mg
from tests.helpers.moe import CUDA, check_moe, make_moe, rel_err


@pytest.fixture
def gemm_calls(monkeypatch):
    """Counts the grouped GEMMs this backend runs (a fallback to the fused kernel runs none)."""
    calls = []
    real = mg.grouped_gemm

    def counting(a, w, offs):
        calls.append(tuple(a.shape))
        return real(a, w, offs)

    monkeypatch.setattr(mg, "grouped_gemm", counting)
    return calls


def check_grouped(p, tol, calls):
    """test_kernels_moe.check_moe (full output and LoRA delta alone) on this backend; its grouped GEMMs must have
    run (2 per call), not the fallback."""
    out, _ = check_moe(p, tol, backend="grouped_mm")
    why = mg.grouped_mm_unsupported(p)
    assert len(calls) == 2 * (1 + (p.lora is not None)), f"grouped GEMMs run: {calls} (fallback: {why})"
    return out


CPU_CASES = [
    # SiLU-gated (Qwen3): 2 adapters + rows without one, slot 1 loaded at rank 7 < max rank 16 (padded slots),
    # top-8 of 8, T odd
    dict(T=37, H=40, I=24, E=8, K=8, activation="silu", ranks=(16, 7)),
    # gpt-oss clamped SwiGLU with per-expert biases on both GEMMs; inputs scaled so the +-7 clamps engage
    dict(T=23, H=48, I=40, E=6, K=4, activation="swiglu_oai", ranks=(8,), bias=True, x_scale=8.0),
    # relu^2 non-gated, top-1, only 3 of 8 experts get rows (empty groups: offs repeats its ends)
    dict(T=29, H=32, I=56, E=8, K=1, activation="relu2", ranks=(4, 12), experts_used=(1, 4, 6)),
    # shared-outer layout (gate_up A and down B stride 0 over experts), last expert without rows
    dict(
        T=31, H=40, I=24, E=5, K=2, activation="silu", ranks=(16, 16, 3), shared_outer=True, experts_used=(0, 1, 2, 3)
    ),
    # 4 adapters of ranks 1..32 in one batch, no rows without an adapter
    dict(T=40, H=24, I=40, E=4, K=3, activation="silu", ranks=(1, 5, 32, 20), none_rows=False),
    # no LoRA: the base path alone, with biases
    dict(T=33, H=40, I=24, E=8, K=8, activation="swiglu_oai", bias=True),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c['activation']}-T{c['T']}-K{c['K']}-r{c.get('ranks')}")
def test_grouped_backend_fp32(case, gemm_calls, tol=1e-5):
    check_grouped(make_moe(**case), tol, gemm_calls)


def test_grouped_backend_bf16(gemm_calls, tol=2e-2):
    """bf16 on CPU: h and y are rounded to bf16 twice each (grouped_mm's output, then the in-place delta), where
    the fused kernel rounds once, and the interpreter converts fp32 to bf16 by truncation (1024 of 1024 values
    equal the truncated ones, against torch's round-to-nearest): 1.3-1.5 % here vs 0.5-0.8 % for the fused
    kernel, hence twice its bound. The GPU test holds the compiled path (round-to-nearest) to 1e-2."""
    check_grouped(
        make_moe(T=19, H=40, I=24, E=4, K=2, activation="silu", ranks=(8, 3), dtype=torch.bfloat16), tol, gemm_calls
    )


def test_rows_without_adapter_equal_base_bit_for_bit(gemm_calls):
    """Slots present but every row on -1: the delta passes must not touch a row."""
    p = make_moe(T=19, H=32, I=24, E=4, K=2, activation="silu", ranks=(8, 8))
    p = replace(p, token_adapter=torch.full_like(p.token_adapter, -1))
    with_slots = moe_forward(p, impl="triton", backend="grouped_mm")
    base = moe_forward(p.without_lora(), impl="triton", backend="grouped_mm")
    assert len(gemm_calls) == 4 and torch.equal(with_slots, base)


# ------------------------------------------------------------------------------------------------------ pieces


def test_sort_by_expert_rows_and_offsets():
    """Rows sorted by expert, every pair exactly once, offs the cumulative ends (an expert without rows repeats
    the previous end): the contract grouped_mm relies on."""
    g = torch.Generator().manual_seed(3)
    E, T, K = 7, 23, 3
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(T)]).to(torch.int32)  # 5, 6 empty
    row_pair, row_expert, offs = mg.sort_by_expert(ids, E)
    assert sorted(row_pair.tolist()) == list(range(T * K))
    assert torch.equal(row_expert.long(), ids.reshape(-1)[row_pair.long()].long())
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    assert offs.dtype == torch.int32 and offs.tolist() == counts.cumsum(0).tolist()


def test_lora_blocks_hold_one_expert_and_slot():
    g = torch.Generator().manual_seed(5)
    E, L, P = 4, 3, 61
    row_expert = torch.sort(torch.randint(0, E, (P,), generator=g)).values.to(torch.int32)
    row_slot = torch.randint(-1, L, (P,), generator=g, dtype=torch.int32)
    r = mg.lora_blocks(row_expert, row_slot, E, L, 16)
    rows = r.sorted_ids[: int(r.num_padded)].view(-1, 16).long()
    for b, blk in enumerate(rows):
        real = blk[blk < P]
        assert (row_expert[real] == r.block_expert[b]).all() and (row_slot[real] == r.block_adapter[b]).all()
    assert sorted(r.sorted_ids[r.sorted_ids < P].tolist()) == list(range(P))


@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True), ("relu2", True)])
def test_bias_act_matches_torch(activation, bias):
    g = torch.Generator().manual_seed(1)
    M, E, I = 45, 3, 72  # I not a multiple of the column block
    n1 = I if activation == "relu2" else 2 * I
    h = torch.randn(M, n1, generator=g) * 6  # clamps engage
    row_expert = torch.sort(torch.randint(0, E, (M,), generator=g)).values.to(torch.int32)
    b = torch.randn(E, n1, generator=g) if bias else None
    out = mg.bias_act(h, row_expert, b, activation)
    assert rel_err(out, mg.bias_act_torch(h, row_expert, b, activation)) <= 1e-6


def test_topk_sum_matches_torch_and_is_deterministic():
    g = torch.Generator().manual_seed(2)
    T, K, E, H = 21, 5, 6, 70
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # int64, as the runtime's router
    w = torch.rand(T, K, generator=g)
    y = torch.randn(T * K, H, generator=g)
    row_of = torch.randperm(T * K, generator=g).to(torch.int32)
    b = torch.randn(E, H, generator=g)
    out = mg.topk_sum(y, row_of, ids, w, b)
    assert rel_err(out, mg.topk_sum_torch(y, row_of, ids, w, b)) <= 1e-6
    assert torch.equal(out, mg.topk_sum(y, row_of, ids, w, b))


# --------------------------------------------------------------------------------------------------- fallbacks


def test_unaligned_widths_and_kernel_faults_fall_back_to_the_fused_kernel(gemm_calls):
    """grouped_mm needs 16-byte strides (H = 37 fp32 has 148) and the zoo's kernel faults live in the fused
    kernel: both run there, correctly, with one warning per reason."""
    p = make_moe(T=13, H=37, I=24, E=4, K=2, activation="silu", ranks=(4,))
    ref = moe_forward(p, impl="torch")
    mg._warned.clear()
    with pytest.warns(UserWarning, match="16-byte aligned"):
        out = moe_forward(p, impl="triton", backend="grouped_mm")
    assert not gemm_calls and rel_err(out, ref) <= 1e-5
    q = make_moe(T=13, H=40, I=24, E=4, K=2, activation="silu", ranks=(4,))
    with faults.injected("lora_after_activation"):
        with pytest.warns(UserWarning, match="lives in the fused kernel"):
            bad = moe_forward(q, impl="triton", backend="grouped_mm")
        want = moe_forward(q, impl="torch")  # the reference carries the fault too
    assert not gemm_calls and rel_err(bad, want) <= 1e-5


def test_bad_backend_is_one_clear_error():
    p = make_moe(T=4, H=16, I=8, E=2, K=1, activation="silu")
    with pytest.raises(ValueError, match="backend must be one of"):
        moe_forward(p, backend="cutlass")


def test_triton_engine_moe_backend_option(gemm_calls, tmp_path):
    """lpdiff.engines.triton with moe_backend="grouped_mm" (kernels interpreted on CPU) gives its torch-reference
    logprobs for a batch with an expert adapter and a prompt without, and a bad value is refused by name."""
    import numpy as np

    from lpdiff.engines.base import EngineConfig
    from lpdiff.engines.triton import TritonEngine
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import get_model, load_hf_model
    from lpdiff.harness.types import AdapterSpec

    spec = get_model("tiny-qwen3-moe", num_layers=2)
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        TritonEngine(EngineConfig(model=spec, device="cpu", options={"moe_backend": "cutlass"}))
    ad = generate_adapter(
        load_hf_model(spec, torch.float32, "cpu"), tmp_path / "a", groups=("experts",), rank=4, seed=1
    )
    adapters = {"a": AdapterSpec("a", str(ad.path))}
    prompts = [[5, 9, 31, 2, 77, 3, 8], [400, 12, 12, 1, 90]]
    got = {}
    for impl in ("torch", "triton"):
        with TritonEngine(
            EngineConfig(
                model=spec,
                adapters=adapters,
                device="cpu",
                dtype="float32",
                options={"impl": impl, "moe_backend": "grouped_mm"},
            )
        ) as eng:
            got[impl] = eng.prompt_logprobs(prompts, ["a", None])
            base = eng.prompt_logprobs(prompts)
    assert len(gemm_calls) == 2 * 2 * 2  # impl triton: 2 calls x 2 layers x 2 GEMMs (torch runs none)
    d = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(got["triton"], got["torch"]))
    effect = float(np.abs(got["triton"][0].logprobs - base[0].logprobs).max())
    assert d <= 1e-4 and effect > 100 * d, (d, effect)


# ------------------------------------------------------------------------------------------------------ GPU

GPU_SHAPES = [
    # Qwen3-30B-A3B experts: 128 x (2048 -> 2x768), top-8; three slots of mixed rank and rows without adapter
    dict(T=517, H=2048, I=768, E=128, K=8, activation="silu", ranks=(32, 8, 17)),
    # gpt-oss-20b experts: 32 x (2880 -> 2x2880), top-4, biases, clamps engaged, shared-outer layout
    dict(
        T=263,
        H=2880,
        I=2880,
        E=32,
        K=4,
        activation="swiglu_oai",
        ranks=(16, 32),
        bias=True,
        shared_outer=True,
        x_scale=4.0,
    ),
    # Qwen3 shape, no LoRA, a third of the experts without rows
    dict(T=300, H=2048, I=768, E=128, K=8, activation="silu", experts_used=tuple(range(0, 128, 3))),
]


@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: f"{c['activation']}-E{c['E']}-r{c.get('ranks')}")
@pytest.mark.gpu1
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_grouped_backend_gpu_bf16(case, gemm_calls, tol=1e-2, tol_vs_triton=1e-2):
    p = make_moe(**case, dtype=torch.bfloat16, device="cuda")
    assert mg.grouped_mm_unsupported(p) is None, "CUTLASS path not taken"
    torch.full((1 << 28,), float("nan"), device="cuda")  # freed at once: unwritten outputs would read NaN
    out = check_grouped(p, tol, gemm_calls)
    fused = moe_forward(p, impl="triton")
    assert rel_err(out, fused) <= tol_vs_triton
    assert torch.equal(out, moe_forward(p, impl="triton", backend="grouped_mm")), "reruns must be bit-identical"
