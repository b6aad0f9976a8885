"""The LoRA shrink S = scaling * X A^T over routed rows, one launch before the GEMM that expands it (LORA 2 of
lora_gemm.py): rows of a routing block share one expert and one adapter slot (moe_align.py), so A is a plain tile.
Its torch reference is the shrink half of lora_weights.lora_delta."""

from __future__ import annotations

import torch

from lpdiff.kernels._triton import dot_flags, dual_jit, next_pow2, tl, triton
from lpdiff.kernels.gemm_config import ShrinkConfig
from lpdiff.kernels.moe_align import MoeRouting

MAX_RANK = 128  # the shrink keeps a (BLOCK_M, next_pow2(R)) fp32 accumulator in registers


def check_kernel_rank(rank: int) -> None:
    if rank > MAX_RANK:
        raise ValueError(f"max rank {rank} > {MAX_RANK} is not supported by the Triton LoRA kernels; use impl='torch'")


@dual_jit
def _lora_shrink_kernel(
    X,
    A,
    S,
    Scaling,
    Ranks,
    SortedIds,
    BlockExpert,
    BlockAdapter,
    NumPadded,
    num_pairs,
    Kdim,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_as,
    stride_ar,
    stride_ak,
    stride_sm,
    stride_sr,
    TOPK: tl.constexpr,
    X_SORTED: tl.constexpr,
    R: tl.constexpr,
    ROUTE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """S[row, s*R : s*R+R] = scaling[a] * X[row] A[a, e, s]^T for every padded row of blocks with an adapter.
    A program covers BLOCK_M rows, a sub-block of a routing block of ROUTE_M rows (one expert, one slot)."""
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    blk = pid // (ROUTE_M // BLOCK_M)
    if blk * ROUTE_M >= tl.load(NumPadded):
        return
    a = tl.load(BlockAdapter + blk)
    if a < 0:
        return  # the expand skips these blocks too, so S rows stay unwritten
    e = tl.load(BlockExpert + blk)
    rank = tl.load(Ranks + a)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # sub-blocks of one block are consecutive programs
    if tl.load(SortedIds + pid * BLOCK_M) >= num_pairs:
        return  # all padding (it sits at the end of its group): no expand reads these rows
    pair = tl.load(SortedIds + offs_m)
    row_ok = pair < num_pairs
    if X_SORTED:
        xrow = offs_m
    else:
        xrow = tl.minimum(pair, num_pairs - 1) // TOPK  # padding rows: a valid address, loaded as zeros
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = (offs_r < rank) & (offs_r < R)  # columns past the loaded rank are ignored even if not zero
    x_ptrs = X + xrow[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = (
        A
        + a.to(tl.int64) * stride_al
        + e.to(tl.int64) * stride_ae
        + sl * stride_as
        + offs_r[None, :] * stride_ar
        + offs_k[:, None] * stride_ak
    )
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k in range(K_TILES):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < Kdim - k * BLOCK_K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    acc = acc * tl.load(Scaling + a)
    s_ptrs = S + offs_m[:, None].to(tl.int64) * stride_sm + (sl * R + offs_r[None, :]) * stride_sr
    tl.store(s_ptrs, acc, mask=offs_r[None, :] < R)


def launch_shrink(
    x,
    a,
    scaling,
    ranks,
    routing: MoeRouting,
    x_sorted: bool,
    cfg: ShrinkConfig | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """a viewed as (L, E, S, R, Kdim) (expand()ed dims may have stride 0) -> S (M, S*R) in dtype, default float32
    (computed in fp32, rounded once on store)."""
    _L, _E, NS, R, Kdim = a.shape
    M = routing.sorted_ids.shape[0]
    s = torch.empty(M, NS * R, dtype=dtype or torch.float32, device=x.device)
    cfg = cfg or ShrinkConfig()
    rows, block_k = cfg.resolve(routing.block_m, next_pow2(R), x.dtype, x.is_cuda)
    grid = (routing.num_blocks * (routing.block_m // rows), NS)
    _lora_shrink_kernel[grid, x.device](
        x,
        a,
        s,
        scaling,
        ranks,
        routing.sorted_ids,
        routing.block_expert,
        routing.block_adapter,
        routing.num_padded,
        routing.num_pairs,
        Kdim,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        a.stride(3),
        a.stride(4),
        s.stride(0),
        s.stride(1),
        TOPK=routing.top_k,
        X_SORTED=x_sorted,
        R=R,
        ROUTE_M=routing.block_m,
        BLOCK_M=rows,
        BLOCK_R=next_pow2(R),
        BLOCK_K=block_k,
        K_TILES=triton.cdiv(Kdim, block_k),
        EVEN_K=Kdim % block_k == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dot_flags(x.dtype, x.device),
    )
    return s
