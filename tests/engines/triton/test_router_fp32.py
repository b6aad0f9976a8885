"""moe.router_logits_fp32, Nemotron-H's router: fp32 sums of the model-dtype products, as transformers forms them.

CPU (and an fp32 model): the fp32 GEMM itself, bit for bit. GPU (gpu1): one half-precision tensor-core GEMM that
accumulates in fp32; against the exact (fp64) sums its error stays within a small multiple of cuBLAS's IEEE fp32
GEMM's (the reference transformers runs), it picks the same experts wherever the choice is not a near-tie, and
logits rounded to bf16 (the defect the fp32 router exists to avoid) fail the same bound by far.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lpdiff.engines.triton.moe import router_logits_fp32


def _case(T, E, H, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, H, generator=g, device=device).to(dtype)  # normed rows: unit scale
    w = (0.02 * torch.randn(E, H, generator=g, device=device)).to(dtype)
    bias = 0.01 * torch.randn(E, generator=g, device=device)  # the correction bias (fp32, the choice only)
    return h, w, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_is_the_fp32_gemm(dtype):
    h, w, _ = _case(37, 12, 72, dtype, "cpu")
    got = router_logits_fp32(h, w)
    assert got.dtype == torch.float32
    assert torch.equal(got, F.linear(h.float(), w.float()))


def _choice(logits, bias, k):
    scores = torch.sigmoid(logits.double()) + bias.double()
    top = torch.topk(scores, k + 1, dim=-1)
    return top.indices[:, :k].sort(dim=-1).values, top.values[:, k - 1] - top.values[:, k]


@pytest.mark.gpu1
@pytest.mark.parametrize(
    "T,E,H,k,dtype",
    [
        (4099, 128, 2688, 6, torch.bfloat16),  # Nano's router, an odd token count
        (1031, 512, 4096, 22, torch.bfloat16),  # Super's
        (517, 128, 2688, 6, torch.float16),
    ],
)
def test_gpu_tensor_core_sums_match_the_fp32_gemm(T, E, H, k, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    h, w, bias = _case(T, E, H, dtype, "cuda", seed=T)
    exact = h.double() @ w.double().t()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # transformers' reference: IEEE fp32
    try:
        ref = F.linear(h.float(), w.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    got = router_logits_fp32(h, w)
    assert got.dtype == torch.float32 and got.shape == (T, E)
    err_ref = (ref.double() - exact).abs().max().item()
    err_got = (got.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    bound = 4 * err_ref + 1e-7 * scale
    assert err_got <= bound, f"tensor-core fp32 sums off by {err_got:.3g}, the fp32 GEMM by {err_ref:.3g}"
    rounded = router_logits_fp32(h, w).to(dtype).float()  # the defect: logits in the model dtype
    assert (rounded.double() - exact).abs().max().item() > 10 * bound
    ids_got, _ = _choice(got, bias, k)
    ids_ref, gap = _choice(exact, bias, k)
    clear = gap > 8 * bound  # rows whose k-th choice is not a near-tie at this error
    assert clear.float().mean().item() > 0.9
    assert torch.equal(ids_got[clear], ids_ref[clear])
