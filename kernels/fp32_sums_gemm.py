"""(T, K) x (N, K)^T -> (T, N) fp32 from bf16/fp16 operands with the sums an IEEE fp32 GEMM forms: a fp32 router's
logits (Nemotron-H: transformers' NemotronHTopkRouter casts its bf16 input and weight to fp32 and multiplies).

The products of two bf16 (fp16) values are exact in fp32, so only the accumulation separates a tensor-core GEMM
from the IEEE fp32 one. The tensor cores do not round their fp32 accumulation as IEEE adds do: on an H200 one
cuBLAS bf16 GEMM with fp32 output (``torch.mm(out_dtype=torch.float32)``) was 5-10x further from the exact (fp64)
sums than cuBLAS's IEEE fp32 GEMM at Nano's and Super's router shapes (3.65e-5 against 7.39e-6 at Super's 4096 x
4096 x 512; benchmarks/results/kernels.md), enough to flip expert choices the reference makes. IEEE fp32 on the CUDA
cores cost 73 us a Nano MoE layer and 409 us a Super one (7.8 ms of Super's 43-layer call).

This kernel promotes each BLOCK_K slice's tensor-core partial sum into a fp32 register accumulator with an IEEE
add (DeepSeek-V3's "promotion to CUDA cores" for fp8, here for bf16): the tensor cores accumulate BLOCK_K / 16
products' worth of their own rounding, the running sum is IEEE. The partial's accumulator starts from a runtime
zero (``zero``): from a constant zero Triton folds ``acc + dot(a, b)`` back into ``dot(a, b, acc)`` (its
CombineDotAdd pattern), which is the tensor-core accumulation again. No library offers it for bf16 (cuBLAS's
fp32-output GEMMs accumulate in the tensor cores; Triton's max_num_imprecise_acc applies to fp8 only), hence a
kernel of our own. Reference: ``fp32_sums_gemm_torch`` (the IEEE fp32 GEMM itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lpdiff.kernels._triton import dual_jit, resolve_impl, tl, triton


def fp32_sums_gemm_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: the IEEE fp32 GEMM of the upcast operands (on CUDA with tf32 off, torch's default for matmul)."""
    return F.linear(x.float(), w.float())


if triton is not None:

    @dual_jit
    def _fp32_sums_gemm_kernel(
        X,
        W,
        Out,
        T,
        N,
        K,
        zero,
        stride_x,
        stride_w,
        stride_o,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptr = X + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
        w_ptr = W + cols[None, :].to(tl.int64) * stride_w + ks[:, None]  # (BLOCK_K, BLOCK_N): W^T's tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        fresh = tl.zeros((BLOCK_M, BLOCK_N), tl.float32) + zero  # not a constant: see the module docstring
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            a = tl.load(x_ptr + k0, mask=(rows[:, None] < T) & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + k0, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
            if UPCAST:  # the interpreter multiplies bf16 tiles' raw bits: upcast (exact) first
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b, fresh, input_precision="ieee" if UPCAST else "tf32")
        tl.store(
            Out + rows[:, None].to(tl.int64) * stride_o + cols[None, :],
            acc,
            mask=(rows[:, None] < T) & (cols[None, :] < N),
        )


def fp32_sums_config(N: int) -> dict:
    """64 x 128 tiles, BLOCK_K 64 (four k16 tensor-core steps a promotion), 4 warps: the fastest of four tilings at
    Nano's and Super's routers on an H200 (32.4 / 53.5 us a layer against 36.8 / 54.4 for 128-row tiles, which
    leave most SMs idle at Nano's 128 experts; BLOCK_K 32 was 50 % slower and no closer to the exact sums;
    benchmarks/results/kernels.md, bench_kernels --router-only)."""
    block_n = 128 if N >= 128 else max(16, 1 << (N - 1).bit_length())
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=3)


def fp32_sums_gemm(x: torch.Tensor, w: torch.Tensor, impl: str = "auto", config: dict | None = None) -> torch.Tensor:
    """x (T, K) and w (N, K) in bf16 or fp16, unit column stride -> (T, N) fp32 with IEEE-accumulated sums of the
    exact products (module docstring). fp32 operands, CPU tensors or impl="torch": the reference. ``config``:
    fp32_sums_config's keys to override (a tile sweep)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be (T, K) and w (N, K) with the same K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if (
        resolve_impl(impl, x) == "torch"
        or x.dtype not in (torch.bfloat16, torch.float16)
        or w.dtype != x.dtype
        or x.stride(-1) != 1
        or w.stride(-1) != 1
    ):
        return fp32_sums_gemm_torch(x, w)
    (T, K), N = x.shape, w.shape[0]
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    cfg = fp32_sums_config(N) | (config or {})
    if not x.is_cuda:  # the interpreter: small tiles, the cost is per program step
        cfg |= dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    grid = (triton.cdiv(T, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _fp32_sums_gemm_kernel[grid, x.device](
        x, w, out, T, N, K, 0.0, x.stride(0), w.stride(0), out.stride(0), UPCAST=not x.is_cuda, **cfg
    )
    return out
