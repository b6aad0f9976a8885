"""Batched dense LoRA (fused base GEMM + per-row adapters, sliced outputs) against its torch reference: CPU cases
through the Triton interpreter in fp32, gpu1 cases compiled in bf16 and fp32."""
from __future__ import annotations

import pytest
import torch

from kernels import lora_linear

CUDA = torch.cuda.is_available()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "kernel output has NaN/inf"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_linear(T, kin, widths, L, R, *, bias=True, none_rows=True, dtype=torch.float32, device="cpu", seed=0):
    """Random inputs; widths are the output slices (q|k|v style); each slot gets its own A per slice."""
    g = torch.Generator().manual_seed(seed)
    n = sum(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    p = dict(x=torch.randn(T, kin, generator=g), w=torch.randn(n, kin, generator=g) * kin ** -0.5,
             bias=torch.randn(n, generator=g) if bias else None, slice_offsets=offs)
    if L:
        ta = torch.randint(-1 if none_rows else 0, L, (T,), generator=g, dtype=torch.int32)
        ta[:L] = torch.arange(L)
        p.update(lora_a=torch.randn(L, len(widths), R, kin, generator=g) * kin ** -0.5,
                 lora_b=torch.randn(L, n, R, generator=g) * R ** -0.5,
                 scaling=torch.rand(L, generator=g) + 0.5, token_adapter=ta)
    return {k: (v.to(device=device, dtype=dtype if v.is_floating_point() and k != "scaling" else v.dtype)
                if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


def check_linear(p, tol):
    ref = lora_linear(**p, impl="torch")
    out = lora_linear(**p, impl="triton")
    assert out.shape == ref.shape and out.dtype == p["x"].dtype
    err = rel_err(out, ref)
    assert err <= tol, f"rel err {err:.3g} > {tol}"
    if "lora_a" in p:  # the delta alone: a slice or a slot silently dropped would show here
        base = {k: v for k, v in p.items() if k in ("x", "w", "bias", "slice_offsets")}
        derr = rel_err(out.float() - lora_linear(**base, impl="triton").float(),
                       ref.float() - lora_linear(**base, impl="torch").float())
        assert derr <= 3 * tol, f"LoRA delta rel err {derr:.3g} > {3 * tol}"
    return out


CPU_CASES = [
    # q|k|v slices of widths that are not multiples of BLOCK_N (one tile straddles two slices), 3 slots + none
    dict(T=37, kin=40, widths=(24, 8, 12), L=3, R=16),
    # one slice, no bias, one slot, T not a multiple of BLOCK_M
    dict(T=19, kin=32, widths=(40,), L=1, R=8, bias=False),
    # gate|up of a shared expert, 4 slots at rank 1 (padded to a 16-wide tile), no none rows
    dict(T=40, kin=24, widths=(20, 20), L=4, R=1, none_rows=False),
    # no LoRA: the fused kernel as a plain GEMM + bias
    dict(T=21, kin=40, widths=(36,), L=0, R=0),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"T{c['T']}-S{len(c['widths'])}-L{c['L']}-R{c['R']}")
def test_lora_linear_interpreter_fp32(case, tol=1e-5):
    check_linear(make_linear(**case), tol)


def test_lora_linear_rows_without_adapter_equal_base():
    p = make_linear(T=17, kin=32, widths=(16, 16), L=2, R=8)
    p["token_adapter"] = torch.full_like(p["token_adapter"], -1)
    base = {k: v for k, v in p.items() if k in ("x", "w", "bias", "slice_offsets")}
    assert torch.equal(lora_linear(**p, impl="triton"), lora_linear(**base, impl="triton"))


def test_lora_linear_bad_inputs():
    p = make_linear(T=4, kin=16, widths=(8, 8), L=1, R=4)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_linear(**dict(p, slice_offsets=[0, 10, 12]))
    with pytest.raises(ValueError, match="lora_a"):
        lora_linear(**dict(p, slice_offsets=None))
    with pytest.raises(ValueError, match="token_adapter"):
        lora_linear(**dict(p, token_adapter=None))


GPU_CASES = [
    # Qwen3-30B-A3B q|k|v (4096 | 512 | 512 from H=2048), 4 slots with none rows
    dict(T=333, kin=2048, widths=(4096, 512, 512), L=4, R=32),
    # gpt-oss o_proj-like odd width, one slot of rank 128
    dict(T=200, kin=4096, widths=(2880,), L=1, R=128),
    # Qwen3.5 linear-attention in_proj-like 5 slices of uneven width, rank 8
    dict(T=129, kin=2048, widths=(2048, 2048, 4096, 32, 32), L=2, R=8),
]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c['T']}-S{len(c['widths'])}-R{c['R']}")
@pytest.mark.gpu1
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_lora_linear_gpu(case, dtype, tol):
    p = make_linear(**case, dtype=dtype, device="cuda")
    torch.full((1 << 28,), float("nan"), device="cuda")  # freed at once: unwritten outputs would read NaN
    out = check_linear(p, tol)
    assert torch.equal(out, lora_linear(**p, impl="triton")), "reruns must be bit-identical"
