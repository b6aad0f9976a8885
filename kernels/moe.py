"""The MoE expert op with multi-adapter LoRA: input checks, then its torch reference (moe_reference.py), the fused
Triton kernel (fused_moe_lora.py) or torch's grouped GEMM with Triton LoRA passes (moe_grouped.py)."""

from __future__ import annotations

import torch

import lpdiff.kernels.faults as faults
from lpdiff.kernels._triton import resolve_impl
from lpdiff.kernels.activation import GATED
from lpdiff.kernels.fused_moe_lora import check_lora_shrink, moe_forward_triton
from lpdiff.kernels.lora_weights import MoeLoraWeights
from lpdiff.kernels.moe_grouped import BACKENDS, moe_forward_grouped
from lpdiff.kernels.moe_reference import moe_forward_torch


def check_moe_inputs(
    x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up, b_down, lora, token_adapter
) -> None:
    """One clear error per bad input, naming the fix; shapes only, so no host synchronisation."""
    if activation not in GATED:
        raise ValueError(f"activation {activation!r} unknown; use one of {sorted(GATED)}")
    if x.ndim != 2:
        raise ValueError(f"x must be (T, H), got {tuple(x.shape)}")
    T, H = x.shape
    if w_gate_up.ndim != 3 or w_gate_up.shape[2] != H:
        raise ValueError(f"w_gate_up must be (E, N1, H={H}) in nn.Linear orientation, got {tuple(w_gate_up.shape)}")
    E, n1, _ = w_gate_up.shape
    inter = n1 // 2 if GATED[activation] else n1
    if GATED[activation] and n1 % 2:
        raise ValueError(f"gated activation {activation!r} needs gate then up rows (N1 = 2I), got N1 = {n1}")
    if w_down.shape != (E, H, inter):
        raise ValueError(
            f"w_down must be (E, H, I) = {(E, H, inter)}, got {tuple(w_down.shape)}"
            + (" (relu2 is not gated: w_gate_up holds I rows)" if activation == "relu2" else "")
        )
    if topk_ids.ndim != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be (T={T}, K), got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype.is_floating_point:
        raise ValueError("topk_ids must be an integer tensor of expert indices")
    if b_gate_up is not None and b_gate_up.shape != (E, n1):
        raise ValueError(f"b_gate_up must be (E, N1) = {(E, n1)}, got {tuple(b_gate_up.shape)}")
    if b_down is not None and b_down.shape != (E, H):
        raise ValueError(f"b_down must be (E, H) = {(E, H)}, got {tuple(b_down.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} is {t.dtype} but x is {x.dtype}; cast the weights to the run dtype")
    if lora is None:
        return
    if token_adapter is None or token_adapter.shape != (T,):
        raise ValueError(
            f"lora given, so token_adapter must be a (T={T},) int tensor of slots (-1 = none); got "
            f"{None if token_adapter is None else tuple(token_adapter.shape)}"
        )
    _, Ea, _, Ha = lora.gate_up_a.shape
    if (Ea, Ha) != (E, H) or lora.gate_up_b.shape[2] != n1 or lora.down_a.shape[3] != inter:
        raise ValueError(
            f"LoRA shapes {tuple(lora.gate_up_a.shape)}/{tuple(lora.gate_up_b.shape)}/"
            f"{tuple(lora.down_a.shape)} do not fit experts E={E}, H={H}, N1={n1}, I={inter}"
        )


def _misread_as_gated(w_down, lora):
    """Fault relu2_as_gated: a runner that knows only gated experts splits the I up rows into gate|up halves,
    applies SiLU-and-mul, and runs the down GEMM (and its LoRA-A) over the first I/2 input columns."""
    half = w_down.shape[2] // 2
    if lora is not None:
        lora = MoeLoraWeights(
            lora.gate_up_a, lora.gate_up_b, lora.down_a[..., :half], lora.down_b, lora.scaling, lora.ranks
        )
    return "silu", w_down[..., :half], lora


def moe_forward(
    x,
    topk_ids,
    topk_weights,
    w_gate_up,
    w_down,
    activation: str,
    b_gate_up=None,
    b_down=None,
    lora: MoeLoraWeights | None = None,
    token_adapter=None,
    impl: str = "auto",
    backend: str = "triton",
    lora_shrink: str = "auto",
    sum_topk: bool = True,
    n_tiles: int | tuple[int, int] | None = None,
    padding: str | None = None,
) -> torch.Tensor:
    """(T, H) MoE output: sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(x[t]) with per-token LoRA slots.

    activation: "silu" (gated SiLU), "swiglu_oai" (gpt-oss clamped SwiGLU, alpha 1.702, limit 7.0),
    "relu2" (non-gated relu(x)^2). Same dtype as x; fp32 accumulation inside.
    backend (impl triton only): "triton" (fused_moe_lora.py) or "grouped_mm" (moe_grouped.py).
    lora_shrink, n_tiles, padding (backend triton only): see moe_forward_triton.
    sum_topk False (impl and backend triton only; the other paths return (T, H) summed): (T, K, H) per-pair
    outputs, already top-k weighted, for the caller to sum."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_lora_shrink(lora_shrink)
    if activation == "relu2" and faults.on("relu2_as_gated"):
        activation, w_down, lora = _misread_as_gated(w_down, lora)
    check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up, b_down, lora, token_adapter)
    args = (x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up, b_down, lora, token_adapter)
    if resolve_impl(impl, x) == "torch":
        return moe_forward_torch(*args)
    if backend == "grouped_mm":
        return moe_forward_grouped(*args)
    return moe_forward_triton(*args, lora_shrink=lora_shrink, sum_topk=sum_topk, n_tiles=n_tiles, padding=padding)
