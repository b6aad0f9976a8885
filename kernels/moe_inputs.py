"""The inputs of one MoE expert op call: what moe.moe_forward, both Triton backends (fused_moe_lora.py,
moe_grouped.py) and the torch reference (moe_reference.py) take, so a kernel and its reference share one contract
that is checked once, when the caller builds it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lpdiff.kernels.activation import GATED
from lpdiff.kernels.lora_weights import MoeLoraWeights


@dataclass(slots=True, frozen=True)
class MoeInputs:
    """Tokens, their top-k routing, the expert weights and the per-token LoRA of one call. Building one checks it:
    one ValueError per bad input, naming the fix; shapes only, so no host synchronisation."""

    x: torch.Tensor  # (T, H)
    topk_ids: torch.Tensor  # (T, K) int expert ids
    topk_weights: torch.Tensor  # (T, K)
    w_gate_up: torch.Tensor  # (E, N1, H) nn.Linear orientation; N1 = 2I (gate rows then up rows) if gated, else I
    w_down: torch.Tensor  # (E, H, I)
    activation: str  # a key of activation.GATED
    b_gate_up: torch.Tensor | None = None  # (E, N1)
    b_down: torch.Tensor | None = None  # (E, H)
    lora: MoeLoraWeights | None = None
    token_adapter: torch.Tensor | None = None  # (T,) int LoRA slot per token (-1 = none); needed with lora only

    def __post_init__(self) -> None:
        _check(self)

    @property
    def slots(self) -> torch.Tensor | None:
        """token_adapter where there is a LoRA to read it, else None (a token_adapter without lora is ignored)."""
        return self.token_adapter if self.lora is not None else None

    def without_lora(self) -> MoeInputs:
        return replace(self, lora=None, token_adapter=None)


def _check(m: MoeInputs) -> None:
    if m.activation not in GATED:
        raise ValueError(f"activation {m.activation!r} unknown; use one of {sorted(GATED)}")
    if m.x.ndim != 2:
        raise ValueError(f"x must be (T, H), got {tuple(m.x.shape)}")
    T, H = m.x.shape
    if m.w_gate_up.ndim != 3 or m.w_gate_up.shape[2] != H:
        raise ValueError(f"w_gate_up must be (E, N1, H={H}) in nn.Linear orientation, got {tuple(m.w_gate_up.shape)}")
    E, n1, _ = m.w_gate_up.shape
    gated = GATED[m.activation]
    inter = n1 // 2 if gated else n1
    if gated and n1 % 2:
        raise ValueError(f"gated activation {m.activation!r} needs gate then up rows (N1 = 2I), got N1 = {n1}")
    if m.w_down.shape != (E, H, inter):
        raise ValueError(
            f"w_down must be (E, H, I) = {(E, H, inter)}, got {tuple(m.w_down.shape)}"
            + (" (relu2 is not gated: w_gate_up holds I rows)" if m.activation == "relu2" else "")
        )
    ids, weights = m.topk_ids, m.topk_weights
    if ids.ndim != 2 or ids.shape[0] != T or weights.shape != ids.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be (T={T}, K), got {tuple(ids.shape)} and {tuple(weights.shape)}"
        )
    if ids.dtype.is_floating_point:
        raise ValueError("topk_ids must be an integer tensor of expert indices")
    if m.b_gate_up is not None and m.b_gate_up.shape != (E, n1):
        raise ValueError(f"b_gate_up must be (E, N1) = {(E, n1)}, got {tuple(m.b_gate_up.shape)}")
    if m.b_down is not None and m.b_down.shape != (E, H):
        raise ValueError(f"b_down must be (E, H) = {(E, H)}, got {tuple(m.b_down.shape)}")
    for name, t in (("w_gate_up", m.w_gate_up), ("w_down", m.w_down)):
        if t.dtype != m.x.dtype:
            raise ValueError(f"{name} is {t.dtype} but x is {m.x.dtype}; cast the weights to the run dtype")
    lora, ta = m.lora, m.token_adapter
    if lora is None:
        return
    if ta is None or ta.shape != (T,):
        raise ValueError(
            f"lora given, so token_adapter must be a (T={T},) int tensor of slots (-1 = none); got "
            f"{None if ta is None else tuple(ta.shape)}"
        )
    _, Ea, _, Ha = lora.gate_up_a.shape
    if (Ea, Ha) != (E, H) or lora.gate_up_b.shape[2] != n1 or lora.down_a.shape[3] != inter:
        raise ValueError(
            f"LoRA shapes {tuple(lora.gate_up_a.shape)}/{tuple(lora.gate_up_b.shape)}/"
            f"{tuple(lora.down_a.shape)} do not fit experts E={E}, H={H}, N1={n1}, I={inter}"
        )
