"""The MoE expert op with multi-adapter LoRA on inputs checked when built (moe_inputs.py): its torch reference
(moe_reference.py), the fused Triton kernel (fused_moe_lora.py) or torch's grouped GEMM with Triton LoRA passes
(moe_grouped.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

import lpdiff.kernels.faults as faults
from lpdiff.kernels._triton import resolve_impl
from lpdiff.kernels.fused_moe_lora import check_lora_shrink, moe_forward_triton
from lpdiff.kernels.moe_grouped import BACKENDS, moe_forward_grouped
from lpdiff.kernels.moe_inputs import MoeInputs
from lpdiff.kernels.moe_reference import moe_forward_torch


def _misread_as_gated(moe: MoeInputs) -> MoeInputs:
    """Fault relu2_as_gated: a runner that knows only gated experts splits the I up rows into gate|up halves,
    applies SiLU-and-mul, and runs the down GEMM (and its LoRA-A) over the first I/2 input columns."""
    half = moe.w_down.shape[2] // 2
    lora = None if moe.lora is None else replace(moe.lora, down_a=moe.lora.down_a[..., :half])
    return replace(moe, activation="silu", w_down=moe.w_down[..., :half], lora=lora)


def moe_forward(
    moe: MoeInputs,
    impl: str = "auto",
    backend: str = "triton",
    lora_shrink: str = "auto",
    sum_topk: bool = True,
    n_tiles: int | tuple[int, int] | None = None,
    padding: str | None = None,
) -> torch.Tensor:
    """(T, H) MoE output: sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(x[t]) with per-token LoRA slots.

    moe.activation: "silu" (gated SiLU), "swiglu_oai" (gpt-oss clamped SwiGLU, alpha 1.702, limit 7.0),
    "relu2" (non-gated relu(x)^2). Same dtype as x; fp32 accumulation inside.
    backend (impl triton only): "triton" (fused_moe_lora.py) or "grouped_mm" (moe_grouped.py).
    lora_shrink, n_tiles, padding (backend triton only): see moe_forward_triton.
    sum_topk False (impl and backend triton only; the other paths return (T, H) summed): (T, K, H) per-pair
    outputs, already top-k weighted, for the caller to sum."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_lora_shrink(lora_shrink)
    if moe.activation == "relu2" and faults.on("relu2_as_gated"):
        moe = _misread_as_gated(moe)
    if resolve_impl(impl, moe.x) == "torch":
        return moe_forward_torch(moe)
    if backend == "grouped_mm":
        return moe_forward_grouped(moe)
    return moe_forward_triton(moe, lora_shrink=lora_shrink, sum_topk=sum_topk, n_tiles=n_tiles, padding=padding)
