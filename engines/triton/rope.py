"""Rotary embedding on q and k, with the optional per-head RMSNorm before it (Qwen3's q_norm / k_norm), fused in
one pass that reads the q|k|v GEMM output once and writes contiguous q and k. ``norm_partial_rope_qk``: Qwen3.5's
form of it (rope on the first rotary_dim dims of each head, the norm's weight in fp32, the rope's products rounded
as transformers' 16-bit ops round them).

Shapes: T tokens, h heads of width d (HALF = d/2). Non-interleaved rope: halves (x1, x2) ->
(x1 cos - x2 sin, x2 cos + x1 sin) — the same arithmetic as transformers' rotate_half (Qwen) and its gpt-oss
variant. cos/sin (T, HALF) are in the model dtype, already multiplied by YaRN's attention scaling.
"""

from __future__ import annotations

import torch

from lpdiff.engines.triton._jit import pow2, tl, triton, use_triton
from lpdiff.engines.triton.norm import rms_norm, rounded


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch reference on (T, h, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def norm_rope_torch(x, weight, eps, cos, sin):
    return rope(x if weight is None else rms_norm(x, weight, eps), cos, sin)


if triton is not None:

    @triton.jit
    def _norm_rope_heads(
        Src,
        Cos,
        Sin,
        W,
        Out,
        t,
        nh,
        eps,
        stride_t,
        stride_c,
        stride_o,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One token's nh heads: optional per-head RMSNorm, then rope."""
        h = tl.arange(0, BLOCK_H)[:, None]
        dd = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < nh) & (dd < HALF)
        src = Src + t * stride_t + h * (2 * HALF) + dd
        x1 = tl.load(src, mask=ok, other=0.0)
        x2 = tl.load(src + HALF, mask=ok, other=0.0)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if NORM:
            r = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.load(W + dd, mask=dd < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(W + HALF + dd, mask=dd < HALF, other=0.0).to(tl.float32)
            # weight * normed.to(dtype), product rounded to the dtype: transformers' Qwen3 RMSNorm
            f1 = (w1 * (f1 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
            f2 = (w2 * (f2 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        c = tl.load(Cos + t * stride_c + dd, mask=dd < HALF, other=0.0).to(tl.float32)
        s = tl.load(Sin + t * stride_c + dd, mask=dd < HALF, other=0.0).to(tl.float32)
        dst = Out + t * stride_o + h * (2 * HALF) + dd
        tl.store(dst, (f1 * c - f2 * s).to(Out.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, (f2 * c + f1 * s).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _norm_rope_qk_kernel(
        SrcQ,
        SrcK,
        Cos,
        Sin,
        WQ,
        WK,
        OutQ,
        OutK,
        nq,
        nk,
        eps,
        stride_tq,
        stride_tk,
        stride_c,
        stride_oq,
        stride_ok,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        _norm_rope_heads(
            SrcQ, Cos, Sin, WQ, OutQ, t, nq, eps, stride_tq, stride_c, stride_oq, HALF, NORM, BLOCK_HQ, BLOCK_D
        )
        _norm_rope_heads(
            SrcK, Cos, Sin, WK, OutK, t, nk, eps, stride_tk, stride_c, stride_ok, HALF, NORM, BLOCK_HK, BLOCK_D
        )


def norm_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    impl: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """q (T, hq, d) and k (T, hk, d), each optionally RMS-normed per head and then roped (norm_rope_torch), in one
    launch; both weights or neither (Qwen3 norms both, gpt-oss neither)."""
    assert (q_weight is None) == (k_weight is None), "q and k are both normed or neither"
    if not use_triton(q, impl):
        return norm_rope_torch(q, q_weight, eps, cos, sin), norm_rope_torch(k, k_weight, eps, cos, sin)
    (T, hq, d), hk = q.shape, k.shape[1]
    assert k.shape == (T, hk, d) and q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == d
    oq = torch.empty(T, hq, d, dtype=q.dtype, device=q.device)
    ok = torch.empty(T, hk, d, dtype=k.dtype, device=k.device)
    norm = q_weight is not None
    _norm_rope_qk_kernel[(T,)](
        q,
        k,
        cos,
        sin,
        q_weight if norm else cos,
        k_weight if norm else cos,
        oq,
        ok,
        hq,
        hk,
        eps,
        q.stride(0),
        k.stride(0),
        cos.stride(0),
        oq.stride(0),
        ok.stride(0),
        HALF=d // 2,
        NORM=norm,
        BLOCK_HQ=pow2(hq),
        BLOCK_HK=pow2(hk),
        BLOCK_D=pow2(d // 2),
        num_warps=4,
    )
    return oq, ok


def norm_partial_rope_torch(x, weight, eps, cos, sin, rotary_dim: int):
    """Reference of Qwen3.5's attention input: RMSNorm with the fp32 weight (1 + w), then rope on the first
    ``rotary_dim`` dims of each head, the rest passed through. x (T, h, d), cos/sin (T, rotary_dim // 2)."""
    x = rms_norm(x, weight, eps, True)
    return torch.cat([rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


if triton is not None:

    @triton.jit
    def _norm_prope_heads(
        Src,
        Cos,
        Sin,
        W,
        Out,
        t,
        nh,
        eps,
        stride_t,
        stride_h,
        stride_c,
        D: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        """One token's nh heads (head stride stride_h in Src, d = D contiguous in Out): RMSNorm over D, the weight
        in fp32 and the product rounded once (Qwen3_5MoeRMSNorm); rope on dims [0, 2 HALF) with every product and
        sum rounded to the dtype, as torch's 16-bit ``x1 * cos - x2 * sin`` rounds each op; dims [2 HALF, D) copied
        normed."""
        h = tl.arange(0, BLOCK_H)[:, None]
        dd = tl.arange(0, BLOCK_HALF)[None, :]
        pp = tl.arange(0, BLOCK_PASS)[None, :]
        ok = (h < nh) & (dd < HALF)
        okp = (h < nh) & (pp < D - 2 * HALF)
        src = Src + t * stride_t + h * stride_h
        x1 = tl.load(src + dd, mask=ok, other=0.0)
        f1 = x1.to(tl.float32)
        f2 = tl.load(src + HALF + dd, mask=ok, other=0.0).to(tl.float32)
        fp = tl.load(src + 2 * HALF + pp, mask=okp, other=0.0).to(tl.float32)
        ss = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1) + tl.sum(fp * fp, axis=1)
        r = tl.math.rsqrt(ss / D + eps)[:, None]
        dt = x1.dtype
        w1 = tl.load(W + dd, mask=dd < HALF, other=0.0)
        w2 = tl.load(W + HALF + dd, mask=dd < HALF, other=0.0)
        wp = tl.load(W + 2 * HALF + pp, mask=pp < D - 2 * HALF, other=0.0)
        y1 = (w1 * (f1 * r)).to(dt).to(tl.float32)
        y2 = (w2 * (f2 * r)).to(dt).to(tl.float32)
        yp = (wp * (fp * r)).to(dt)
        c = tl.load(Cos + t * stride_c + dd, mask=dd < HALF, other=0.0).to(tl.float32)
        s = tl.load(Sin + t * stride_c + dd, mask=dd < HALF, other=0.0).to(tl.float32)
        o1 = rounded(y1 * c, dt) - rounded(y2 * s, dt)
        o2 = rounded(y2 * c, dt) + rounded(y1 * s, dt)
        dst = Out + t * (nh * D) + h * D
        tl.store(dst + dd, o1.to(Out.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + dd, o2.to(Out.dtype.element_ty), mask=ok)
        tl.store(dst + 2 * HALF + pp, yp.to(Out.dtype.element_ty), mask=okp)

    @triton.jit
    def _norm_prope_qk_kernel(
        SrcQ,
        SrcK,
        Cos,
        Sin,
        WQ,
        WK,
        OutQ,
        OutK,
        nq,
        nk,
        eps,
        stride_tq,
        stride_hq,
        stride_tk,
        stride_hk,
        stride_c,
        D: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        _norm_prope_heads(
            SrcQ, Cos, Sin, WQ, OutQ, t, nq, eps, stride_tq, stride_hq, stride_c, D, HALF, BLOCK_HQ, BLOCK_HALF,
            BLOCK_PASS,
        )  # fmt: skip
        _norm_prope_heads(
            SrcK, Cos, Sin, WK, OutK, t, nk, eps, stride_tk, stride_hk, stride_c, D, HALF, BLOCK_HK, BLOCK_HALF,
            BLOCK_PASS,
        )  # fmt: skip


def norm_partial_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, hq, d) and k (T, hk, d), unit stride along d (any token and head strides: q may be the query half of
    Qwen3.5's query|gate heads), with fp32 weights (d,) -> contiguous norm_partial_rope_torch(q), (k), in one launch
    reading each once (the torch form is 25 passes over q and k)."""
    if not use_triton(q, impl):
        return (
            norm_partial_rope_torch(q, q_weight, eps, cos, sin, rotary_dim),
            norm_partial_rope_torch(k, k_weight, eps, cos, sin, rotary_dim),
        )
    (T, hq, d), hk = q.shape, k.shape[1]
    if not (
        k.shape == (T, hk, d)
        and q.stride(2) == k.stride(2) == 1
        and rotary_dim % 2 == 0
        and 0 < rotary_dim <= d
        and cos.shape == sin.shape == (T, rotary_dim // 2)
        and cos.stride(1) == 1
        and q_weight.dtype == k_weight.dtype == torch.float32
    ):
        raise ValueError(
            f"norm_partial_rope_qk: q {tuple(q.shape)} k {tuple(k.shape)} (unit stride along d), cos {tuple(cos.shape)}"
            f" (T, rotary_dim // 2 = {rotary_dim // 2}), fp32 weights ({q_weight.dtype}, {k_weight.dtype})"
        )
    oq = torch.empty(T, hq, d, dtype=q.dtype, device=q.device)
    ok = torch.empty(T, hk, d, dtype=k.dtype, device=k.device)
    half = rotary_dim // 2
    _norm_prope_qk_kernel[(T,)](
        q,
        k,
        cos,
        sin,
        q_weight,
        k_weight,
        oq,
        ok,
        hq,
        hk,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        D=d,
        HALF=half,
        BLOCK_HQ=pow2(hq),
        BLOCK_HK=pow2(hk),
        BLOCK_HALF=pow2(half),
        BLOCK_PASS=pow2(d - 2 * half),
        num_warps=4,
    )
    return oq, ok
