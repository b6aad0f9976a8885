"""RMSNorm (optionally fused with the residual add before it) in the two rounding orders the supported models use.

Shapes: T tokens, H hidden, K top-k. Qwen casts the normalised row back to the model dtype and then multiplies by
the weight in that dtype; gpt-oss keeps its weight in fp32 and multiplies before casting back (``weight_fp32``).
The residual sum is rounded to the model dtype before it is normalised, as transformers' ``residual + h`` is.

The delta added to the residual may be the MoE's unsummed top-k outputs (T, K, H) (kernels.moe_forward with
sum_topk=False): they are summed here in fp32 in k order and rounded to the model dtype once, then added. That is
the rounding of the unfused ``y.view(T, K, H).sum(1)`` (transformers' grouped_mm / batched_mm experts sum the same
way; its eager expert loop instead accumulates in the model dtype with index_add_, in expert order), and fusing it
saves a separate reduction's (T, K, H) read and its (T, H) write and re-read. Only the order of the fp32 additions
may differ from torch's reduction (on CUDA it combines K = 8 values as four interleaved partial sums): the results
differ only where an fp32 sum of bf16 values is inexact and lands next to a bf16 rounding boundary.

A shared expert's output (T, H) may ride along (``shared``, optionally scaled by sigmoid of a per-token gate logit
(T, 1), Qwen3.5's shared_expert_gate): it is added to the rounded top-k sum in the kernel with the roundings of the
unfused ``routed + sigmoid(gate) * shared`` (moe_delta), so the MoE block's tail (the sum, the sigmoid, the product,
the add) costs no pass of its own.
"""

from __future__ import annotations

import torch

from lpdiff.engines.triton._jit import INTERPRETED, pow2, tl, triton, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """Torch reference (also used for the per-head q/k norm on CPU)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_fp32:
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def sum_topk(delta: torch.Tensor) -> torch.Tensor:
    """(T, H) as is, or (T, K, H) -> (T, H): the sum over k in fp32 in k order, rounded once to delta's dtype."""
    if delta.ndim == 2:
        return delta
    acc = delta[:, 0].float()
    for k in range(1, delta.shape[1]):
        acc = acc + delta[:, k].float()  # out of place: for fp32 .float() is delta itself
    return acc.to(delta.dtype)


def moe_delta(delta: torch.Tensor, shared: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """sum_topk(delta), plus the shared expert's output scaled by sigmoid(gate) (T, 1) where given: the MoE block's
    output as the torch ops round it."""
    out = sum_topk(delta)
    if shared is None:
        return out
    return out + (shared if gate is None else torch.sigmoid(gate) * shared)


def add_rms_norm_torch(x, delta, weight, eps, weight_fp32=False, shared=None, shared_gate=None):
    s = x if delta is None else x + moe_delta(delta, shared, shared_gate)
    return rms_norm(s, weight, eps, weight_fp32), s


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def torch_sigmoid(x, EXACT: tl.constexpr):
        """fp32 sigmoid with torch's CUDA bits when EXACT: 1 / (1 + expf(-x)), IEEE division. The interpreter has no
        libdevice: there tl.exp and / (which compiled are approximate: ex2.approx, div.full)."""
        if EXACT:
            y = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))
        else:
            y = 1.0 / (1.0 + tl.exp(-x))
        return y

    @triton.jit
    def rounded(x, dt: tl.constexpr):
        """fp32 x rounded to dt (nearest even) and back to fp32, where a torch op rounds its result, in a form the
        compiler cannot fold away. The sm90 build (Triton 3.6) turns ``x.to(bf16).to(tl.float32)`` followed by an add
        into bf16 arithmetic and then one FMA with x unrounded: the partial rope's products put 5.8 % of bf16 q
        elements one ulp off torch's on an H200 (a CPU emulation of that contraction gives 5.79 %), and the MoE tail's
        sigmoid(gate) * shared compiles to fma.rn.bf16x2. bf16 is rounded on the bits (finite values; a carry into
        the exponent is the rounding up to the next binade or to inf, as the cast's); other dtypes by the cast."""
        if dt == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            return u.to(tl.float32, bitcast=True)
        else:  # noqa: RET505 (both returns inside the constexpr if: the form the sm90 build was checked in)
            return x.to(dt).to(tl.float32)

    @triton.jit
    def torch_silu(x, EXACT: tl.constexpr):
        """fp32 SiLU with torch's CUDA bits when EXACT: x / (1 + expf(-x)) (as torch_sigmoid)."""
        if EXACT:
            y = tl.math.div_rn(x, 1.0 + libdevice.exp(-x))
        else:
            y = x / (1.0 + tl.exp(-x))
        return y

    @triton.jit
    def _add_rms_norm_kernel(
        X,
        D,
        W,
        Out,
        Sum,
        Sh,
        Gt,
        H,
        eps,
        stride_x,
        stride_d,
        stride_dk,
        stride_o,
        stride_s,
        stride_sh,
        stride_g,
        HAS_DELTA: tl.constexpr,
        K: tl.constexpr,
        WEIGHT_FP32: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_SHARED: tl.constexpr = False,
        HAS_GATE: tl.constexpr = False,
        EXACT: tl.constexpr = True,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(D + row * stride_d + offs, mask=ok, other=0.0)
            acc = d.to(tl.float32)
            for k in tl.static_range(1, K):  # k order, fp32, one rounding below (sum_topk)
                acc += tl.load(D + row * stride_d + k * stride_dk + offs, mask=ok, other=0.0).to(tl.float32)
            acc = acc.to(d.dtype).to(tl.float32)
            if HAS_SHARED:  # routed + sigmoid(gate) * shared, each op rounded to the dtype (moe_delta)
                sh = tl.load(Sh + row * stride_sh + offs, mask=ok, other=0.0).to(tl.float32)
                if HAS_GATE:
                    gl = tl.load(Gt + row * stride_g).to(tl.float32)
                    sg = torch_sigmoid(gl, EXACT).to(d.dtype).to(tl.float32)
                    sh = rounded(sg * sh, d.dtype)  # the product feeds an add: rounded (see rounded)
                acc = (acc + sh).to(d.dtype).to(tl.float32)
            x = (x.to(tl.float32) + acc).to(Sum.dtype.element_ty)
            tl.store(Sum + row * stride_s + offs, x, mask=ok)
        xf = x.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHT_FP32:
            y = w * (xf * r)
        else:
            y = w * (xf * r).to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=ok)


def check_delta(x: torch.Tensor, delta: torch.Tensor | None, shared=None, shared_gate=None) -> None:
    T, H = x.shape
    if shared is not None and (
        delta is None or shared.shape != (T, H) or shared.dtype != x.dtype or shared.stride(-1) != 1
    ):
        raise ValueError(f"shared must come with a delta and be (T, H) = {(T, H)} {x.dtype} with contiguous rows")
    if shared_gate is not None and (shared is None or shared_gate.shape != (T, 1) or shared_gate.dtype != x.dtype):
        raise ValueError(f"shared_gate must come with shared and be (T, 1) = {(T, 1)} {x.dtype}")
    if delta is not None and not (
        delta.ndim in (2, 3) and delta.shape[0] == T and delta.shape[-1] == H and delta.dtype == x.dtype
    ):
        raise ValueError(
            f"delta must be (T, H) = {(T, H)} or (T, K, H) (the MoE's unsummed top-k outputs) in "
            f"{x.dtype}, got {tuple(delta.shape)} {delta.dtype}"
        )


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_fp32: bool = False,
    impl: str = "auto",
    out: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H) x, delta (T, H) or (T, K, H) -> (rms_norm(x + sum_topk(delta)), x + sum_topk(delta)): the next
    sublayer's input and the new residual stream. ``out``: a (T, H) view with unit column stride (e.g. the first H
    columns of the q|k|v LoRA's augmented input) that receives the normed rows in place of a new tensor.
    ``shared`` (T, H) and ``shared_gate`` (T, 1): a shared expert's output and gate logit added to the delta as
    moe_delta adds them."""
    check_delta(x, delta, shared, shared_gate)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(
            f"out must be a (T, H) = {tuple(x.shape)} {x.dtype} view with unit column stride, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if not use_triton(x, impl):
        normed, s = add_rms_norm_torch(x, delta, weight, eps, weight_fp32, shared, shared_gate)
        return (normed if out is None else out.copy_(normed)), s
    T, H = x.shape
    out = torch.empty_like(x) if out is None else out
    s = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x
    assert d.stride(-1) == 1, "delta rows must be contiguous"
    K, stride_dk = (d.shape[1], d.stride(1)) if d.ndim == 3 else (1, 0)
    block = pow2(H)
    _add_rms_norm_kernel[(T,)](
        x,
        d,
        weight,
        out,
        s,
        x if shared is None else shared,
        x if shared_gate is None else shared_gate,
        H,
        eps,
        x.stride(0),
        d.stride(0),
        stride_dk,
        out.stride(0),
        s.stride(0),
        0 if shared is None else shared.stride(0),
        0 if shared_gate is None else shared_gate.stride(0),
        HAS_DELTA=delta is not None,
        K=K,
        WEIGHT_FP32=weight_fp32,
        BLOCK=block,
        HAS_SHARED=shared is not None,
        HAS_GATE=shared_gate is not None,
        EXACT=not INTERPRETED,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, s
