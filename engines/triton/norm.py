"""RMSNorm (optionally fused with the residual add before it) in the two rounding orders the supported models use.

Shapes: T tokens, H hidden. Qwen casts the normalised row back to the model dtype and then multiplies by the
weight in that dtype; gpt-oss keeps its weight in fp32 and multiplies before casting back (``weight_fp32``).
The residual sum is rounded to the model dtype before it is normalised, as transformers' ``residual + h`` is.
"""
from __future__ import annotations

import torch

from engines.triton._jit import pow2, tl, triton, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """Torch reference (also used for the per-head q/k norm on CPU)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_fp32:
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm_torch(x, delta, weight, eps, weight_fp32=False):
    s = x if delta is None else x + delta
    return rms_norm(s, weight, eps, weight_fp32), s


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(X, D, W, Out, Sum, H, eps, stride_x, stride_d, stride_o, stride_s,
                             HAS_DELTA: tl.constexpr, WEIGHT_FP32: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(D + row * stride_d + offs, mask=ok, other=0.0).to(tl.float32))
            x = x.to(Sum.dtype.element_ty)
            tl.store(Sum + row * stride_s + offs, x, mask=ok)
        xf = x.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHT_FP32:
            y = w * (xf * r)
        else:
            y = w * (xf * r).to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 weight_fp32: bool = False, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) -> (rms_norm(x + delta), x + delta): the next sublayer's input and the new residual stream."""
    if not use_triton(x, impl):
        return add_rms_norm_torch(x, delta, weight, eps, weight_fp32)
    T, H = x.shape
    out = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    block = pow2(H)
    _add_rms_norm_kernel[(T,)](x, d, weight, out, s, H, eps, x.stride(0), d.stride(0), out.stride(0), s.stride(0),
                               HAS_DELTA=delta is not None, WEIGHT_FP32=weight_fp32, BLOCK=block,
                               num_warps=min(16, max(1, block // 256)))
    return out, s
