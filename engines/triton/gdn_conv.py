"""Gated DeltaNet's input pass on the fla path in one Triton launch: the causal depthwise conv1d over the packed
prompts, its SiLU, and the L2 norm of every q and k head that fla's delta rule would otherwise run first
(``use_qk_l2norm_in_kernel``), writing q, k and v contiguous.

It replaces, per layer, fla 0.5.2's causal_conv1d_fwd once per q / k / v channel group, a torch SiLU after each,
and fla's l2norm_fwd on q and on k: 7 launches that read and write the (T, C) activations 5 times over (on an H200
at 8 x 512 tokens, Qwen3.5-35B-A3B: ~105 us per layer, ~3.2 ms per call; the pass reads (T, C) once and writes it
once, ~33 us of bytes). As tiled here it took 152 us per layer on that H200, slower than the chain, so
qwen3_5.FUSED_GDN_INPUT leaves it off until its tiles are tuned; the gpu1 test holds its bits to fla's. Roundings as
the chain's: the conv's fp32 sum rounded to the dtype, the SiLU computed in
fp32 and rounded again (torch's conv then SiLU, transformers' reference without causal-conv1d), the L2 norm in fp32
on the rounded SiLU output and rounded once (fla's l2norm_fwd). Only the order of the conv's K fp32 products and
of the norm's sum may differ from those kernels' own.

Each token reads the K - 1 tokens before it only while they belong to its own prompt (its position in the prompt,
Batch.positions), which is the per-prompt zero window of the chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lpdiff.engines.triton._jit import INTERPRETED, pow2, tl, triton
from lpdiff.engines.triton.norm import torch_silu

EPS = 1e-6  # fla 0.5.2's l2norm_fwd default, which its delta rule uses


def l2norm_torch(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """fla's l2norm_fwd as torch ops: x * (1 / sqrt(sum(x^2) + eps)) over the last dim in fp32, rounded to x's
    dtype."""
    xf = x.float()
    return (xf * (1 / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps))).to(x.dtype)


def conv_silu_l2norm_torch(x, weight, positions, nk: int, dk: int, nv: int, dv: int):
    """Reference: x (T, C) packed, weight (C, K), positions (T,) -> q (T, nk, dk) and k L2-normed per head, v
    (T, nv, dv), from silu(causal depthwise conv) rounded to x's dtype after the conv and after the SiLU."""
    T, C = x.shape
    K = weight.shape[1]
    acc = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    xf, wf = x.float(), weight.float()
    for j in range(K):  # tap j reads token t - (K - 1 - j), inside the prompt only
        back = K - 1 - j
        shifted = torch.zeros_like(xf)
        shifted[back:] = xf[: T - back] if back else xf
        acc += wf[:, j] * shifted * (positions >= back)[:, None]
    y = F.silu(acc.to(x.dtype))
    q, k, v = y.split([nk * dk, nk * dk, nv * dv], dim=-1)
    return l2norm_torch(q.reshape(T, nk, dk)), l2norm_torch(k.reshape(T, nk, dk)), v.reshape(T, nv, dv)


if triton is not None:

    @triton.jit
    def _conv_silu_l2norm_kernel(
        X,
        W,
        Pos,
        Q,
        Kout,
        V,
        T,
        stride_x,
        NK,
        NV,
        DK: tl.constexpr,
        DV: tl.constexpr,
        KW: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        eps,
        EXACT: tl.constexpr,
    ):
        """Program (token block, head): heads 0..NK-1 are q's, NK..2NK-1 k's, then v's."""
        hb = tl.program_id(1)
        is_qk = hb < 2 * NK
        if is_qk:
            c0 = hb * DK
            width = DK
        else:
            c0 = 2 * NK * DK + (hb - 2 * NK) * DV
            width = DV
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_C)
        row_ok = rows < T
        col_ok = cols < width
        pos = tl.load(Pos + rows, mask=row_ok, other=0)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(KW):
            back = KW - 1 - j
            src = rows - back
            ok = (row_ok & (pos >= back))[:, None] & col_ok[None, :]
            xv = tl.load(X + src[:, None].to(tl.int64) * stride_x + c0 + cols[None, :], mask=ok, other=0.0)
            w = tl.load(W + (c0 + cols) * KW + j, mask=col_ok, other=0.0).to(tl.float32)
            acc += xv.to(tl.float32) * w[None, :]
        dt = X.dtype.element_ty
        y = acc.to(dt).to(tl.float32)
        y = torch_silu(y, EXACT).to(dt).to(tl.float32)  # torch's SiLU on the rounded conv, rounded
        if is_qk:
            y = y * (1 / tl.sqrt(tl.sum(y * y, axis=1) + eps))[:, None]  # as fla's l2norm_fwd_kernel writes it
        out_ok = row_ok[:, None] & col_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        if hb < NK:
            tl.store(Q + r64 * (NK * DK) + hb * DK + cols[None, :], y.to(dt), mask=out_ok)
        elif is_qk:
            tl.store(Kout + r64 * (NK * DK) + (hb - NK) * DK + cols[None, :], y.to(dt), mask=out_ok)
        else:
            tl.store(V + r64 * (NV * DV) + (hb - 2 * NK) * DV + cols[None, :], y.to(dt), mask=out_ok)


def conv_silu_l2norm(
    x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, nk: int, dk: int, nv: int, dv: int
):
    """conv_silu_l2norm_torch in one launch: x (T, C) with unit column stride (the q|k|v column block of the in
    projection), weight (C, K) in x's dtype, positions (T,) -> contiguous q, k (T, nk, dk), v (T, nv, dv)."""
    T, C = x.shape
    KW = weight.shape[1]
    if 2 * nk * dk + nv * dv != C or weight.shape[0] != C or weight.dtype != x.dtype or x.stride(1) != 1:
        raise ValueError(
            f"conv_silu_l2norm: x (T, 2 nk dk + nv dv = {2 * nk * dk + nv * dv}) with unit column stride and a "
            f"(C, K) weight in its dtype; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    q = torch.empty(T, nk, dk, dtype=x.dtype, device=x.device)
    k = torch.empty(T, nk, dk, dtype=x.dtype, device=x.device)
    v = torch.empty(T, nv, dv, dtype=x.dtype, device=x.device)
    block_t = 16  # 16 x 128 tiles on 8 warps: 62 registers (sm_90a, ptxas -v), 4 programs resident per SM
    _conv_silu_l2norm_kernel[(triton.cdiv(T, block_t), 2 * nk + nv)](
        x,
        weight.contiguous(),
        positions,
        q,
        k,
        v,
        T,
        x.stride(0),
        nk,
        nv,
        DK=dk,
        DV=dv,
        KW=KW,
        BLOCK_T=block_t,
        BLOCK_C=pow2(max(dk, dv)),
        eps=EPS,
        EXACT=not INTERPRETED,
        num_warps=8,
    )
    return q, k, v
