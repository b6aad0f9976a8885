"""The runtime's own fused kernels (residual add + RMSNorm, with the MoE's top-k sum fused in; q/k norm + rope;
router top-k) against their torch references, run through the Triton interpreter on CPU.

They are plain triton.jit kernels (they use tl.sum / tl.max, which the interpreter only runs when TRITON_INTERPRET=1
is set before triton is imported), so the checks run in a child Python started with that variable.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.helpers.paths import REPO

ROOT = REPO


def _close(got, ref, tol, what):
    """Elementwise error relative to the element's magnitude (floor 1): bf16 results may differ by a rounding."""
    err = ((got.float() - ref.float()).abs() / ref.float().abs().clamp(min=1)).max().item()
    assert err <= tol, f"{what}: max relative error {err:.3g} > {tol}"


def check_add_rms_norm(dtype, tol):
    from lpdiff.engines.triton.norm import add_rms_norm, add_rms_norm_torch

    g = torch.Generator().manual_seed(0)
    T, H = 5, 72  # H not a power of two: masked tail of the row block
    x = torch.randn(T, H, generator=g).to(dtype)
    delta = torch.randn(T, H, generator=g).to(dtype)
    for weight_fp32 in (False, True):  # Qwen and gpt-oss rounding orders
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.float32 if weight_fp32 else dtype)
        for d in (None, delta):  # first layer has nothing to add yet
            out, s = add_rms_norm(x, d, w, 1e-6, weight_fp32, impl="triton")
            ref_out, ref_s = add_rms_norm_torch(x, d, w, 1e-6, weight_fp32)
            _close(s, ref_s, tol if dtype != torch.float32 else 0.0, f"residual sum {dtype}")
            _close(out, ref_out, tol, f"rms_norm {dtype} weight_fp32={weight_fp32} delta={d is not None}")


def topk_outputs(T, K, H, dtype, g):
    """(T, K, H) like the MoE's weighted per-pair outputs: magnitudes spread over a few decades, so that fp32 sums
    of them are not always exact."""
    return (torch.randn(T, K, H, generator=g) * torch.exp(2 * torch.randn(T, K, 1, generator=g))).to(dtype)


def order_probe(dtype):
    """One K=8 row whose fp32 sum rounds differently in k order and in four interleaved partial sums (torch's CUDA
    reduction): 16, half an ulp of 16 in ``dtype``, half and a quarter of fp32's ulp of 16 (at k 2 and 6). In k
    order both small terms are lost to ties to even and the cast ties back to 16; summed first (3/4 ulp) they tip
    it to 16 + 1 ulp. Pins k order."""
    half_ulp = 8 * torch.finfo(dtype).eps
    row = torch.zeros(1, 8, 4)
    row[0, :, :] = torch.tensor([16, half_ulp, 2**-20, 0, 0, 0, 2**-21, 0])[:, None]
    return row.to(dtype)


def check_add_rms_norm_topk(dtype):
    """The MoE's top-k sum fused into the residual add + RMSNorm against the unfused path (torch's sum, then the
    (T, H) norm): bit-identical in 16-bit dtypes (one fp32 sum, one rounding), for the torch reference always and
    for the kernel where the interpreter rounds as the GPU does (fp16; its bf16 casts truncate). fp32 sums are
    inexact, so there torch's own summation order shows (relative 1e-6); the kernel's residual equals the torch
    reference's bit for bit in fp32 and fp16 (both sum in k order)."""
    from lpdiff.engines.triton.norm import add_rms_norm, add_rms_norm_torch, sum_topk

    def same(a, b, what):
        if dtype == torch.float32:
            _close(a, b, 1e-6, what)
        else:
            assert torch.equal(a, b), what

    g = torch.Generator().manual_seed(3)
    T, H = 6, 75  # odd H: masked tail of the row block
    x = torch.randn(T, H, generator=g).to(dtype)
    for K in (1, 2, 8):  # K=1: a top-1 router, (T, 1, H); 2: the tiny zoo; 8: Qwen3-30B-A3B
        delta = topk_outputs(T, K, H, dtype, g)
        unfused = delta.sum(dim=1)
        same(sum_topk(delta), unfused, f"sum_topk vs torch sum {dtype} K={K}")
        for weight_fp32 in (False, True):  # Qwen and gpt-oss rounding orders
            w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.float32 if weight_fp32 else dtype)
            what = f"add_rms_norm top-k {dtype} K={K} weight_fp32={weight_fp32}"
            ref = add_rms_norm_torch(x, delta, w, 1e-6, weight_fp32)
            for a, b in zip(ref, add_rms_norm_torch(x, unfused, w, 1e-6, weight_fp32)):
                same(a, b, what + " torch reference vs unfused")
            got = add_rms_norm(x, delta, w, 1e-6, weight_fp32, impl="triton")
            if dtype != torch.bfloat16:
                for a, b in zip(got, add_rms_norm(x, unfused, w, 1e-6, weight_fp32, impl="triton")):
                    same(a, b, what + " kernel vs unfused kernel")
                assert torch.equal(got[1], ref[1]), what + " residual vs torch reference"
            # the row's sum of squares is reduced in another order than torch's mean: close, not bit for bit
            _close(got[1], ref[1], 3e-2, what + " residual")
            _close(got[0], ref[0], 3e-2 if dtype == torch.bfloat16 else 2e-3, what)
            # the normed rows written into a strided view (the q|k|v LoRA's augmented input) are the same rows
            buf = torch.full((T, H + 7), float("nan"), dtype=dtype)
            out, _ = add_rms_norm(x, delta, w, 1e-6, weight_fp32, impl="triton", out=buf[:, :H])
            assert out.data_ptr() == buf.data_ptr() and torch.equal(buf[:, :H], got[0]), what + " out="
            assert buf[:, H:].isnan().all(), what + " wrote past its columns"
    if dtype != torch.float32:  # k order, not torch's CUDA order
        probe = order_probe(dtype)
        assert torch.equal(sum_topk(probe), torch.full((1, 4), 16.0, dtype=dtype)), f"k order {dtype}"
        if dtype == torch.float16:
            got = add_rms_norm(torch.zeros(1, 4, dtype=dtype), probe, torch.ones(4, dtype=dtype), 1e-6, impl="triton")[
                1
            ]
            assert torch.equal(got, sum_topk(probe)), "kernel k order"


def check_norm_rope(dtype, tol):
    from lpdiff.engines.triton.rope import norm_rope_qk, norm_rope_torch

    g = torch.Generator().manual_seed(1)
    T, h, hkv, d = 7, 3, 1, 16  # 3 heads: masked head rows; q is a strided view into the q|k|v GEMM output
    qkv = torch.randn(T, (h + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = torch.randn(T, d // 2, generator=g).to(dtype), torch.randn(T, d // 2, generator=g).to(dtype)
    q = qkv[:, : h * d].view(T, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(T, hkv, d)
    for w in (None, (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)):  # gpt-oss (no norm) and Qwen (q_norm)
        # q and k in one launch, k_norm distinct from q_norm (a kernel that used one weight for both would fail)
        wk = None if w is None else (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
        got_q, got_k = norm_rope_qk(q, k, w, wk, 1e-6, cos, sin, impl="triton")
        _close(got_q, norm_rope_torch(q, w, 1e-6, cos, sin), tol, f"norm_rope_qk q {dtype} norm={w is not None}")
        _close(got_k, norm_rope_torch(k, wk, 1e-6, cos, sin), tol, f"norm_rope_qk k {dtype} norm={w is not None}")


def check_route(dtype, tol):
    from lpdiff.engines.triton.moe import route_torch

    g = torch.Generator().manual_seed(2)
    # T=37: not a multiple of the 16-row block; K=E: every expert chosen, the margin is +inf
    for E, K, softmax_all, norm in [
        (8, 2, True, True),
        (8, 2, True, False),
        (8, 4, False, False),
        (6, 6, True, True),
        (32, 4, False, False),
    ]:
        logits = torch.randn(37, E, generator=g).to(dtype)
        ids, w, m = torch.empty(37, K, dtype=torch.int64), torch.empty(37, K), torch.empty(37)

        route_kernel(logits, ids, w, m, K, softmax_all, norm)
        rids, rw, rm = route_torch(logits, K, softmax_all, norm)
        what = f"route {dtype} E={E} K={K} softmax_all={softmax_all} norm={norm}"
        assert torch.equal(ids, rids), what
        _close(w, rw, tol, what + " weights")
        if K < E:
            _close(m, rm, 1e-6, what + " margin")
        else:
            assert torch.isinf(m).all() and torch.isinf(rm).all(), what
        # MIN_INTO: the margin buffer holds earlier layers' minimum (some rows below, some above this layer's)
        prev = (
            torch.rand(37, generator=torch.Generator().manual_seed(E * 10 + K))
            * 2
            * torch.where(torch.isinf(rm), 1.0, rm.abs().float() + 1e-3)
        )
        acc = prev.clone()
        route_kernel(logits, ids, w, acc, K, softmax_all, norm, MIN_INTO=True)
        _close(acc, torch.minimum(prev, rm), 1e-6, what + " running minimum")


def route_kernel(logits, ids, w, margins, K, softmax_all, norm, **min_into) -> None:
    """The routing kernel over 37 tokens in 3 programs of 16, writing ids, weights and margins in place."""
    import lpdiff.engines.triton.moe as moe

    E = logits.shape[1]
    moe._route_kernel[(3,)](
        logits,
        ids,
        w,
        margins,
        37,
        E,
        logits.stride(0),
        K=K,
        SOFTMAX_ALL=softmax_all,
        NORM_TOPK=norm,
        BLOCK_T=16,
        BLOCK_E=moe.pow2(E),
        BLOCK_K=moe.pow2(K),
        **min_into,
    )


def run_all():
    # bf16: the interpreter truncates fp32 -> bf16 casts (compiled Triton rounds to nearest), so allow a few
    # 2^-7 steps; the rounding orders themselves are checked in fp32 and by the GPU parity tests
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        check_add_rms_norm_topk(dtype)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        check_add_rms_norm(dtype, tol)
        check_norm_rope(dtype, tol)
        check_route(dtype, tol)
    print("all fused-kernel checks passed")


def test_fused_kernels_match_torch_references_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all fused-kernel checks passed" in proc.stdout


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the test (it sets TRITON_INTERPRET=1)"
    run_all()
