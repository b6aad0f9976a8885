"""The expert activations: their names and kernel codes, the torch reference, and the Triton tile functions the
grouped GEMM's epilogue and moe_grouped.py's bias + activation pass share.

The torch reference takes gate then up halves; the tile functions take the GEMM's interleaved (gate, up) columns.
gpt-oss's clamped SwiGLU uses alpha 1.702 and limit 7.0 (OAI_ALPHA, OAI_LIMIT; written out in _act). relu2_: the
squared ReLU of a dense output in place, one pass (Nemotron-H's shared expert and dense MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lpdiff.kernels._triton import dual_jit, resolve_impl, tl, triton

ACTIVATIONS = {"none": 0, "silu": 1, "swiglu_oai": 2, "relu2": 3}
GATED = {"silu": True, "swiglu_oai": True, "relu2": False}
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu2":
        return torch.relu(h).square()
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=OAI_LIMIT), up.clamp(min=-OAI_LIMIT, max=OAI_LIMIT)
        return (up + 1) * gate * torch.sigmoid(OAI_ALPHA * gate)
    raise ValueError(f"unknown activation {activation!r}; use one of {sorted(GATED)}")


@triton.jit
def _gated_act(acc, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Interleaved (gate, up) columns of acc -> the gated activation (BLOCK_M, BLOCK_N)."""
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    return _act(gate, up, ACT)


@triton.jit
def _act(gate, up, ACT: tl.constexpr):
    """The gated activation of same-shape gate and up tiles."""
    if ACT == 1:  # SiLU-gated
        h = gate / (1.0 + tl.exp(-gate)) * up
    else:  # gpt-oss clamped SwiGLU
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        h = (up + 1.0) * gate / (1.0 + tl.exp(-1.702 * gate))
    return h


@dual_jit
def _relu2_kernel(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    x = tl.where(x < 0.0, 0.0, x)  # not maximum: a NaN stays NaN, as torch.relu keeps it
    tl.store(X + offs, (x * x).to(X.dtype.element_ty), mask=ok)


def relu2_(h: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """relu(h)² in place, returned: the bits of activate(h, "relu2") (the square of a bf16 value in fp32, rounded
    once). One pass over h instead of torch's two (relu, then square): on an H200 the two took 15 + 15 us a
    Nemotron-3-Nano shared expert (4096 x 3712 bf16), 0.73 ms a call over its 23 MoE layers (e2e.md)."""
    if resolve_impl(impl, h) == "torch" or not h.is_contiguous():
        return h.relu_().square_()
    n, block = h.numel(), 4096
    _relu2_kernel[(triton.cdiv(n, block),), h.device](h, n, BLOCK=block)
    return h
