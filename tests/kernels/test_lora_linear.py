"""Batched dense LoRA (per-row adapters, sliced outputs) against its torch reference, on the three paths: the
default "cublas" (base, shrink and expand as vendor GEMMs, no Triton launch), "triton_delta" (vendor GEMM base +
in-place Triton LoRA pass) and "fused" (one Triton kernel). CPU cases: the cublas path on CPU torch GEMMs, the
Triton paths through the interpreter, fp32 (and bf16 where the interpreter allows); gpu1 cases compiled in bf16 and
fp32."""

from __future__ import annotations

import pytest
import torch

from lpdiff.kernels import lora_linear
from lpdiff.kernels.lora_linear import (
    PATHS,
    augment_weight,
    base_linear,
    exact_matmuls,
    ieee_fp32_matmul,
    lora_linear_aug,
    lora_linear_shrink_out,
    pack_lora_b,
    slot_one_hot,
    stack_shrink_rows,
)
from tests.helpers.lora_linear import make_linear

CUDA = torch.cuda.is_available()
ALL_PATHS = pytest.mark.parametrize("path", PATHS)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "kernel output has NaN/inf"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def base_of(p):
    return {k: v for k, v in p.items() if k in ("x", "w", "bias", "slice_offsets")}


def check_linear(p, tol, path="cublas"):
    ref = lora_linear(**p, impl="torch")
    out = lora_linear(**p, impl="triton", path=path)
    assert out.shape == ref.shape and out.dtype == p["x"].dtype
    err = rel_err(out, ref)
    assert err <= tol, f"rel err {err:.3g} > {tol}"
    if "lora_a" in p:  # the delta alone: a slice or a slot silently dropped would show here
        derr = rel_err(
            out.float() - lora_linear(**base_of(p), impl="triton", path=path).float(),
            ref.float() - lora_linear(**base_of(p), impl="torch").float(),
        )
        assert derr <= 3 * tol, f"LoRA delta rel err {derr:.3g} > {3 * tol}"
        if path != "fused":  # rows without an adapter get an exact zero added (cublas) or are not touched
            # (triton_delta): they are the vendor GEMM's, bit for bit
            none = p["token_adapter"] < 0
            assert torch.equal(out[none], base_linear(p["x"], p["w"], p["bias"])[none])
    return out


CPU_CASES = [
    # q|k|v slices of widths that are not multiples of BLOCK_N (one tile straddles two slices), 3 slots + none
    dict(T=37, kin=40, widths=(24, 8, 12), L=3, R=16),
    # one slice, no bias, one slot, T not a multiple of BLOCK_M
    dict(T=19, kin=32, widths=(40,), L=1, R=8, bias=False),
    # gate|up of a shared expert, 4 slots at rank 1 (padded to a 16-wide tile), no none rows
    dict(T=40, kin=24, widths=(20, 20), L=4, R=1, none_rows=False),
    # no LoRA: the fused kernel as a plain GEMM + bias, the default path as the vendor GEMM alone
    dict(T=21, kin=40, widths=(36,), L=0, R=0),
    # 5 slots of true ranks 3/16/1/9/5 zero-padded to 16; odd Kin (shrink K tail) and k|v widths; row blocks of
    # one slot that end mid-tile next to blocks of another
    dict(T=53, kin=72, widths=(40, 12, 12), L=5, R=16, ranks=(3, 16, 1, 9, 5)),
]


@ALL_PATHS
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"T{c['T']}-S{len(c['widths'])}-L{c['L']}-R{c['R']}")
def test_lora_linear_cpu_fp32(case, path, tol=1e-5):
    check_linear(make_linear(**case), tol, path)


@ALL_PATHS
def test_lora_linear_rows_without_adapter_equal_base(path):
    p = make_linear(T=17, kin=32, widths=(16, 16), L=2, R=8)
    p["token_adapter"] = torch.full_like(p["token_adapter"], -1)
    assert torch.equal(lora_linear(**p, impl="triton", path=path), lora_linear(**base_of(p), impl="triton", path=path))


def test_fused_keyword_is_the_fused_path():
    # benchmarks/bench_kernels.py and older callers pass fused=True
    p = make_linear(T=19, kin=24, widths=(16, 8), L=2, R=4)
    assert torch.equal(lora_linear(**p, impl="triton", fused=True), lora_linear(**p, impl="triton", path="fused"))


@pytest.mark.parametrize("path", ["cublas", "triton_delta"])
def test_lora_linear_bf16_cpu(path, tol=1e-2):
    # both paths' base is F.linear in bf16 and their LoRA adds to a bf16 out: the run dtype end to end (the fused
    # kernel's bf16 tl.dot is garbage in the interpreter, docs/engines.md)
    p = make_linear(T=24, kin=32, widths=(16, 24), L=2, R=8, dtype=torch.bfloat16)
    check_linear(p, tol, path)


# the cublas path with what the engine precomputes (b_packed once per layer, the (T, L) slot mask once per batch,
# or the one slot of a batch whose prompts all use it) against the reference and against building them on the fly
CUBLAS_CASES = [
    # q|k|v of three different widths, none of T, Kin, N a multiple of 16, 3 slots + rows without an adapter
    dict(T=45, kin=37, widths=(26, 10, 7), L=3, R=8),
    # o-like: one slice, no bias, 2 slots, no none rows
    dict(T=29, kin=50, widths=(43,), L=2, R=16, bias=False, none_rows=False),
    # 4 slots of true ranks 2/8/5/1 zero-padded to 8 (padded columns must add nothing), none rows
    dict(T=61, kin=27, widths=(30, 14, 14), L=4, R=8, ranks=(2, 8, 5, 1)),
    # a single slot at rank 1 mixed with rows without an adapter
    dict(T=13, kin=19, widths=(11, 5), L=1, R=1),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CUBLAS_CASES, ids=lambda c: f"T{c['T']}-K{c['kin']}-S{len(c['widths'])}-L{c['L']}")
def test_cublas_path_precomputed_pieces(case, dtype, tol):
    p = make_linear(**case, dtype=dtype, seed=case["T"])
    out = check_linear(p, tol)
    L, R = case["L"], case["R"]
    b_packed = pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"], R)
    mask = slot_one_hot(p["token_adapter"], L, dtype)
    assert torch.equal(lora_linear(**p, impl="triton", b_packed=b_packed, slot_mask=mask), out)
    for slot in range(L):  # every row on one slot: the maskless branch that reads only that slot's columns
        one = dict(p, token_adapter=torch.full_like(p["token_adapter"], slot))
        got = lora_linear(**one, impl="triton", b_packed=b_packed, uniform_slot=slot)
        assert rel_err(got, lora_linear(**one, impl="torch")) <= tol
        # against the masked branch: the same sums up to the order of the expand's additions
        assert rel_err(got, lora_linear(**one, impl="triton")) <= tol / 10


def aug_inputs(p, fill=float("nan")):
    """lora_linear_aug's inputs for make_linear's case p: W_aug = [w | B_packed] and xa (T, Kin + L*S*R) holding x
    and, in the shrink columns, ``fill`` (NaN: whatever a reused buffer held; the shrink must overwrite it)."""
    L, S, R, kin = p["lora_a"].shape
    w_aug = augment_weight(p["w"], pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"], R))
    xa = torch.full((p["x"].shape[0], kin + L * S * R), fill, dtype=p["x"].dtype, device=p["x"].device)
    xa[:, :kin] = p["x"]
    return xa, w_aug


def check_aug(p, tol, **kw):
    """lora_linear_aug against the reference, its delta alone, and x left as it was in xa."""
    xa, w_aug = aug_inputs(p)
    kin = p["x"].shape[1]
    mask = None if "uniform_slot" in kw else slot_one_hot(p["token_adapter"], p["lora_a"].shape[0], p["x"].dtype)
    out = lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"], mask, **kw)
    with exact_matmuls(p["x"].dtype):  # the reference too is IEEE whatever the caller set (TF32 under "high")
        ref = lora_linear(**p, impl="torch")
    assert out.shape == ref.shape and out.dtype == p["x"].dtype
    assert rel_err(out, ref) <= tol, f"rel err {rel_err(out, ref):.3g} > {tol}"
    base = lora_linear(**base_of(p), impl="torch")
    derr = rel_err(out.float() - base.float(), ref.float() - base.float())
    assert derr <= 3 * tol, f"LoRA delta rel err {derr:.3g} > {3 * tol}"
    assert torch.equal(xa[:, :kin], p["x"]), "the input columns must stay x"
    return out, xa, w_aug


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CUBLAS_CASES, ids=lambda c: f"T{c['T']}-K{c['kin']}-S{len(c['widths'])}-L{c['L']}")
def test_lora_linear_aug_matches_reference(case, dtype, tol):
    """The q|k|v LoRA as extra K of the base GEMM: slot-masked (several adapters, rows without one) and one-slot
    batches, against the reference; the one-slot branch zeroes the other slots' columns itself or trusts a buffer
    that already holds zeros there, with the same result."""
    p = make_linear(**case, dtype=dtype, seed=case["T"])
    out, _, w_aug = check_aug(p, tol)
    none = p["token_adapter"] < 0  # rows without an adapter: the base plus exact zeros (K order may differ)
    assert rel_err(out[none], base_linear(p["x"], p["w"], p["bias"])[none]) <= tol / 10
    # base-only batches run on the strided view W_aug[:, :Kin]: the base GEMM itself
    view = w_aug[:, : p["x"].shape[1]]
    assert view.data_ptr() == w_aug.data_ptr() and torch.equal(view, p["w"])
    for slot in range(case["L"]):
        one = dict(p, token_adapter=torch.full_like(p["token_adapter"], slot))
        got, xa, _ = check_aug(one, tol, uniform_slot=slot)
        trusted = xa.clone()
        trusted[:, p["x"].shape[1] :] = 0
        trusted[:, : p["x"].shape[1]] = p["x"]
        again = lora_linear_aug(trusted, w_aug, p["bias"], p["lora_a"], uniform_slot=slot, others_zero=True)
        assert torch.equal(again, got)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CUBLAS_CASES, ids=lambda c: f"T{c['T']}-K{c['kin']}-S{len(c['widths'])}-L{c['L']}")
def test_lora_linear_shrink_out_matches_reference(case, dtype, tol):
    """The o projection's LoRA with the shrink as extra output rows of the base GEMM ([w ; A_all]): slot-masked
    (several adapters, rows without one) and one-slot batches against the reference, the delta alone too; the
    result is the first N columns of the wider product; base-only batches use the contiguous view W_s[:N]."""
    p = make_linear(**case, dtype=dtype, seed=case["T"])
    L, S, R, _kin = p["lora_a"].shape
    n = p["w"].shape[0]
    b_packed = pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"], R)
    w_s, bias_s = stack_shrink_rows(p["w"], p["lora_a"], p["bias"])
    assert w_s[:n].is_contiguous() and w_s[:n].data_ptr() == w_s.data_ptr() and torch.equal(w_s[:n], p["w"])
    base = lora_linear(**base_of(p), impl="torch")
    for slot in (None, *range(L)):
        one = p if slot is None else dict(p, token_adapter=torch.full_like(p["token_adapter"], slot))
        mask = slot_one_hot(one["token_adapter"], L, dtype) if slot is None else None
        got = lora_linear_shrink_out(one["x"], w_s, bias_s, n, b_packed, S * R, mask, slot)
        with exact_matmuls(dtype):
            ref = lora_linear(**one, impl="torch")
        assert got.shape == ref.shape and got.dtype == dtype and got.stride() == (n + L * S * R, 1)
        assert rel_err(got, ref) <= tol, f"slot {slot}: rel err {rel_err(got, ref):.3g} > {tol}"
        derr = rel_err(got.float() - base.float(), ref.float() - base.float())
        assert derr <= 3 * tol, f"slot {slot}: LoRA delta rel err {derr:.3g} > {3 * tol}"
    with pytest.raises(ValueError, match="w_s must be"):  # the plain weight: no shrink rows
        lora_linear_shrink_out(p["x"], p["w"].T.contiguous(), None, n, b_packed, S * R, uniform_slot=0)
    with pytest.raises(ValueError, match="exactly one of slot_mask"):
        lora_linear_shrink_out(p["x"], w_s, bias_s, n, b_packed, S * R)


def test_lora_linear_aug_bad_inputs():
    p = make_linear(T=4, kin=16, widths=(8, 8), L=2, R=4)
    xa, w_aug = aug_inputs(p, 0.0)
    mask = slot_one_hot(p["token_adapter"], 2, torch.float32)
    with pytest.raises(ValueError, match="xa must be"):  # x alone, without the shrink columns
        lora_linear_aug(p["x"], w_aug, p["bias"], p["lora_a"], mask)
    with pytest.raises(ValueError, match="w_aug must be"):  # the plain weight
        lora_linear_aug(xa, p["w"], p["bias"], p["lora_a"], mask)
    with pytest.raises(ValueError, match="exactly one of slot_mask"):
        lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"], mask, uniform_slot=0)
    with pytest.raises(ValueError, match="exactly one of slot_mask"):
        lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"])
    with pytest.raises(ValueError, match="uniform_slot"):
        lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"], uniform_slot=2)
    with pytest.raises(ValueError, match="b_packed must be"):
        augment_weight(p["w"], pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"]).double())


def test_pack_lora_b_is_block_diagonal_and_scaled():
    # the layout that the expand relies on, element by element: slice s of slot l sees only its own rows
    p = make_linear(T=4, kin=8, widths=(5, 3, 2), L=2, R=3)
    packed = pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"]).view(10, 2, 3, 3)
    offs = p["slice_offsets"]
    for l in range(2):
        for s in range(3):
            rows = torch.arange(10)
            inside = (rows >= offs[s]) & (rows < offs[s + 1])
            torch.testing.assert_close(
                packed[inside, l, s], p["scaling"][l] * p["lora_b"][l, inside], rtol=1e-6, atol=0
            )
            assert (packed[~inside, l, s] == 0).all()


@ALL_PATHS
def test_row_parallel_shards_sum_to_the_whole(path, tol=1e-5):
    # tensor parallelism's o projection: x, w and A split on Kin, B whole, the bias on one rank only; the sum of
    # the ranks' outputs (the engine's all-reduce) must be the unsharded result
    p = make_linear(T=33, kin=48, widths=(40,), L=3, R=8)
    k = 20
    parts = [
        dict(p, x=p["x"][:, :k], w=p["w"][:, :k].contiguous(), lora_a=p["lora_a"][..., :k].contiguous()),
        dict(p, x=p["x"][:, k:], w=p["w"][:, k:].contiguous(), lora_a=p["lora_a"][..., k:].contiguous(), bias=None),
    ]
    got = sum(lora_linear(**q, impl="triton", path=path) for q in parts)
    assert rel_err(got, lora_linear(**p, impl="torch")) <= tol


@pytest.fixture
def restore_matmul_precision():
    yield
    torch.set_float32_matmul_precision("highest")
    for flags in (torch.backends, torch.backends.cuda.matmul, torch.backends.mkldnn.matmul):
        flags.fp32_precision = "none"


# what a user may have set before calling us: the legacy API (TF32 in cuBLAS; "medium" also bf16 in oneDNN),
# or the new per-backend API only
USER_PRECISIONS = {
    "high": lambda: torch.set_float32_matmul_precision("high"),
    "medium": lambda: torch.set_float32_matmul_precision("medium"),
    "new-api-tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
}


def matmul_flags():
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision


@pytest.mark.parametrize("user", USER_PRECISIONS)
def test_ieee_fp32_matmul_forces_and_restores(user, restore_matmul_precision):
    USER_PRECISIONS[user]()
    before = matmul_flags()
    assert before != ("ieee", "ieee")
    with ieee_fp32_matmul():
        assert matmul_flags() == ("ieee", "ieee")
        assert not torch.backends.cuda.matmul.allow_tf32  # what cuBLAS reads; raises if legacy and new disagree
    assert matmul_flags() == before
    if user != "new-api-tf32":  # torch itself refuses to read the legacy flag after new-API settings
        assert torch.get_float32_matmul_precision() == user


def test_lora_linear_bad_inputs():
    p = make_linear(T=4, kin=16, widths=(8, 8), L=1, R=4)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_linear(**dict(p, slice_offsets=[0, 10, 12]))
    with pytest.raises(ValueError, match="lora_a"):
        lora_linear(**dict(p, slice_offsets=None))
    with pytest.raises(ValueError, match="token_adapter"):
        lora_linear(**dict(p, token_adapter=None))
    with pytest.raises(ValueError, match="b_packed"):  # B packed for other slices (or not packed at all)
        lora_linear(**p, b_packed=pack_lora_b(p["lora_b"], p["scaling"]))
    with pytest.raises(ValueError, match="slot_mask"):
        lora_linear(**p, slot_mask=slot_one_hot(p["token_adapter"], 2, torch.float32))
    with pytest.raises(ValueError, match="uniform_slot"):
        lora_linear(**p, uniform_slot=1)
    with pytest.raises(ValueError, match="path"):
        lora_linear(**p, path="cutlass")
    with pytest.raises(ValueError, match="R="):
        pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"], R=8)


GPU_CASES = [
    # Qwen3-30B-A3B q|k|v (4096 | 512 | 512 from H=2048), 4 slots with none rows
    dict(T=333, kin=2048, widths=(4096, 512, 512), L=4, R=32),
    # gpt-oss o_proj-like odd width, one slot of rank 128
    dict(T=200, kin=4096, widths=(2880,), L=1, R=128),
    # Qwen3.5 linear-attention in_proj-like 5 slices of uneven width, rank 8
    dict(T=129, kin=2048, widths=(2048, 2048, 4096, 32, 32), L=2, R=8),
]


@ALL_PATHS
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c['T']}-S{len(c['widths'])}-R{c['R']}")
@pytest.mark.gpu1
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_lora_linear_gpu(case, dtype, tol, path):
    p = make_linear(**case, dtype=dtype, device="cuda")
    torch.full((1 << 28,), float("nan"), device="cuda")  # freed at once: unwritten outputs would read NaN
    out = check_linear(p, tol, path)
    assert torch.equal(out, lora_linear(**p, impl="triton", path=path)), "reruns must be bit-identical"
    if path == "cublas":  # what the engine passes: packed B, the batch's mask; and the one-slot branch
        b_packed = pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"])
        mask = slot_one_hot(p["token_adapter"], case["L"], dtype)
        assert torch.equal(lora_linear(**p, impl="triton", b_packed=b_packed, slot_mask=mask), out)
        one = dict(p, token_adapter=torch.zeros_like(p["token_adapter"]))
        got = lora_linear(**one, impl="triton", b_packed=b_packed, uniform_slot=0)
        assert rel_err(got, lora_linear(**one, impl="torch")) <= tol


@pytest.mark.gpu1
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_lora_linear_gpu_fp32_ignores_tf32_setting(restore_matmul_precision, tol=1e-5):
    # a TF32 base GEMM (inputs rounded to 10 mantissa bits: ~5e-4 relative at Kin 2048) would fail the bound;
    # the user's setting must survive the call
    p = make_linear(**GPU_CASES[0], dtype=torch.float32, device="cuda")
    ref = lora_linear(**p, impl="torch")  # before the setting: the reference's own matmul stays IEEE
    torch.set_float32_matmul_precision("high")
    err = rel_err(lora_linear(**p, impl="triton"), ref)
    assert err <= tol, f"rel err {err:.3g} > {tol}: the fp32 base GEMM ran in TF32?"
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.gpu1
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_lora_linear_aug_gpu_writes_in_place(dtype, tol, restore_matmul_precision):
    """Qwen3-30B-A3B's q|k|v with 4 slots: lora_linear_aug matches the reference (fp32 IEEE under a TF32 setting),
    and a warm call allocates only its output: the shrink GEMM writes straight into xa's strided column block and
    the base-only GEMM reads the strided view W_aug[:, :Kin], with no copy of either."""
    p = make_linear(**GPU_CASES[0], dtype=dtype, device="cuda")
    torch.set_float32_matmul_precision("high")
    mask = slot_one_hot(p["token_adapter"], GPU_CASES[0]["L"], dtype)
    check_aug(p, tol)
    xa, w_aug = aug_inputs(p)
    view = w_aug[:, : p["x"].shape[1]]
    runs = {
        "aug": lambda: lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"], mask),
        "uniform": lambda: lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"], uniform_slot=1),
        "base view": lambda: base_linear(p["x"], view, p["bias"]),
    }
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        fn()
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
        assert allocs == 1, f"{name}: {allocs} allocations, expected only the output (a copy of a strided operand?)"
    # the strided view may pick another cuBLAS kernel than the contiguous weight: equal up to rounding
    assert rel_err(runs["base view"](), base_linear(p["x"], p["w"], p["bias"])) <= tol / 10
