"""kernels/fp32_sums_gemm.py: bf16/fp16 operands, fp32 output with IEEE-accumulated sums (a fp32 router's logits).

CPU: the Triton interpreter against the reference (the IEEE fp32 GEMM) at odd sizes (K not a multiple of the tile,
rows and columns past whole tiles); impl "auto" on a CPU is that reference (Nemotron-H's router there). GPU (gpu1),
compiled at Nano's and Super's router shapes: against the exact (fp64) sums its error stays within 2x that of
cuBLAS's IEEE fp32 GEMM (the bound a tensor-core-accumulated bf16 GEMM with fp32 output missed by 10-20x on an
H200: the kernel's module docstring), and it picks the same experts wherever the choice is not a near-tie.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lpdiff.kernels.fp32_sums_gemm import fp32_sums_gemm, fp32_sums_gemm_torch


def _case(T, N, K, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, K, generator=g, device=device).to(dtype)  # normed rows: unit scale
    w = (0.02 * torch.randn(N, K, generator=g, device=device)).to(dtype)
    return x, w


@pytest.mark.parametrize("T,N,K", [(37, 12, 72), (5, 40, 33), (19, 7, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interpreter_matches_the_ieee_gemm(T, N, K, dtype):
    x, w = _case(T, N, K, dtype, seed=T * N + K)
    got = fp32_sums_gemm(x, w, impl="triton")
    want = fp32_sums_gemm_torch(x, w)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_auto_on_cpu_is_the_ieee_gemm():
    x, w = _case(37, 12, 72, torch.bfloat16)
    assert torch.equal(fp32_sums_gemm(x, w), F.linear(x.float(), w.float()))
    x32, w32 = x.float(), w.float()  # an fp32 model: the reference whatever the impl
    assert torch.equal(fp32_sums_gemm(x32, w32, impl="triton"), F.linear(x32, w32))


def test_bad_shapes_name_the_problem():
    x, w = _case(4, 3, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="same K"):
        fp32_sums_gemm(x, w[:, :8])


def _choice(logits, bias, k):
    scores = torch.sigmoid(logits.double()) + bias.double()
    top = torch.topk(scores, k + 1, dim=-1)
    return top.indices[:, :k].sort(dim=-1).values, top.values[:, k - 1] - top.values[:, k]


@pytest.mark.gpu1
@pytest.mark.parametrize(
    "T,N,K,k,dtype",
    [
        (4099, 128, 2688, 6, torch.bfloat16),  # Nano's router, an odd token count
        (1031, 512, 4096, 22, torch.bfloat16),  # Super's
        (517, 120, 2680, 6, torch.float16),  # columns and K past whole tiles
    ],
)
def test_gpu_sums_as_close_as_the_ieee_gemm(T, N, K, k, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x, w = _case(T, N, K, dtype, "cuda", seed=T)
    bias = 0.01 * torch.randn(N, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    exact = x.double() @ w.double().t()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # transformers' reference: IEEE fp32
    try:
        ref = F.linear(x.float(), w.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    got = fp32_sums_gemm(x, w)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    err_ref = (ref.double() - exact).abs().max().item()
    err_got = (got.double() - exact).abs().max().item()
    bound = 2 * err_ref + 1e-7
    assert err_got <= bound, f"promoted sums off by {err_got:.3g}, the IEEE fp32 GEMM by {err_ref:.3g}"
    ids_got, _ = _choice(got, bias, k)
    ids_ref, gap = _choice(exact, bias, k)
    clear = gap > 8 * bound  # rows whose k-th choice is not a near-tie at this error
    assert clear.float().mean().item() > 0.9
    assert torch.equal(ids_got[clear], ids_ref[clear])
