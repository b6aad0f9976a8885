"""The LoRA weights of the expert GEMMs (every adapter slot stacked, zero-padded to the max rank) and the reference
LoRA delta every torch reference adds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class MoeLoraWeights:
    """One layer's expert LoRA for L adapter slots, zero-padded to max rank R."""

    gate_up_a: torch.Tensor  # (L, E, R, H)   may be expand()ed with stride 0 on E (shared-outer layout)
    gate_up_b: torch.Tensor  # (L, E, N1, R)  N1 = 2I (gated) or I; rows in kernel layout (gate then up)
    down_a: torch.Tensor  # (L, E, R, I)
    down_b: torch.Tensor  # (L, E, H, R)   may be stride 0 on E (shared-outer)
    scaling: torch.Tensor  # (L,) float32 alpha/r per slot
    ranks: torch.Tensor  # (L,) int32 loaded rank per slot (<= R); columns past it are ignored

    def __post_init__(self):
        L, E, R, H = self.gate_up_a.shape
        N1 = self.gate_up_b.shape[2]
        I = self.down_a.shape[3]
        assert self.gate_up_b.shape == (L, E, N1, R), f"gate_up_b {tuple(self.gate_up_b.shape)} != (L,E,N1,R)"
        assert self.down_a.shape == (L, E, R, I), f"down_a {tuple(self.down_a.shape)} != {(L, E, R, I)}"
        assert self.down_b.shape == (L, E, H, R), f"down_b {tuple(self.down_b.shape)} != {(L, E, H, R)}"
        assert self.scaling.shape == (L,) and self.scaling.dtype == torch.float32, "scaling must be (L,) float32"
        assert self.ranks.shape == (L,), "ranks must be (L,) int (loaded rank of each slot)"

    @property
    def num_slots(self) -> int:
        return self.gate_up_a.shape[0]

    @property
    def max_rank(self) -> int:
        return self.gate_up_a.shape[2]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling, rank: int) -> torch.Tensor:
    """scaling * (x A[:rank]^T) B[:, :rank]^T in fp32; x (m, in), a (R, in), b (out, R)."""
    return float(scaling) * (x.float() @ a[:rank].float().T) @ b[:, :rank].float().T
