"""Routing alignment for grouped GEMMs: sort (token, expert) pairs by adapter then expert and pad every group to
the GEMM block size, so that each block of BLOCK_M rows has one expert and one adapter slot.

Shapes: T tokens, K top-k, E experts, L adapter slots, P = T*K pairs, G = (L+1)*E groups (slot -1 = no adapter
comes first), M_max = padded row capacity, NB = M_max / BLOCK_M blocks.

Everything stays on the device: the capacity is an upper bound known from shapes alone, and the number of rows
actually used (num_padded) is a device tensor that the kernels read, so no host synchronisation happens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class MoeRouting:
    sorted_ids: torch.Tensor     # (M_max,) int32 pair index t*K+k per padded row; P marks a padding row
    block_expert: torch.Tensor   # (NB,) int32 expert of each block
    block_adapter: torch.Tensor  # (NB,) int32 adapter slot of each block, -1 = none
    num_padded: torch.Tensor     # (1,) int32 rows in use (a multiple of block_m); blocks past it are idle
    block_m: int
    num_pairs: int
    top_k: int

    def __post_init__(self):
        assert self.sorted_ids.shape[0] % self.block_m == 0
        assert self.block_expert.shape == self.block_adapter.shape == (self.sorted_ids.shape[0] // self.block_m,)

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_padded_rows(num_pairs: int, num_groups: int, block_m: int) -> int:
    # each non-empty group wastes at most block_m - 1 rows, and at most min(P, G) groups are non-empty
    rows = num_pairs + min(num_pairs, num_groups) * (block_m - 1)
    return max(block_m, -(-rows // block_m) * block_m)


def moe_align(topk_ids: torch.Tensor, token_adapter: torch.Tensor | None, num_experts: int, num_slots: int,
              block_m: int) -> MoeRouting:
    """topk_ids (T, K) int, token_adapter (T,) int (slot, -1 = none) or None -> MoeRouting.

    Pairs keep their original order inside a group (stable sort), so the layout is deterministic."""
    assert topk_ids.ndim == 2, f"topk_ids must be (T, K), got {tuple(topk_ids.shape)}"
    T, K = topk_ids.shape
    dev = topk_ids.device
    P, E = T * K, num_experts
    G = (num_slots + 1) * E
    ids = topk_ids.reshape(-1).long()
    if token_adapter is None or num_slots == 0:
        gid = ids
    else:
        assert token_adapter.shape == (T,), f"token_adapter must be ({T},), got {tuple(token_adapter.shape)}"
        slot = token_adapter.long().clamp(min=-1).repeat_interleave(K)
        gid = (slot + 1) * E + ids
    counts = torch.zeros(G, dtype=torch.long, device=dev).scatter_add_(0, gid, torch.ones_like(gid))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.sort(gid, stable=True).indices
    g_sorted = gid[order]
    first = counts.cumsum(0) - counts  # index of each group's first pair in sorted order
    dest = (pad_end - padded)[g_sorted] + torch.arange(P, device=dev) - first[g_sorted]
    m_max = max_padded_rows(P, G, block_m)
    sorted_ids = torch.full((m_max,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, m_max, block_m, device=dev)
    block_gid = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=G - 1)
    return MoeRouting(sorted_ids=sorted_ids,
                      block_expert=(block_gid % E).to(torch.int32),
                      block_adapter=(block_gid // E - 1).to(torch.int32),
                      num_padded=pad_end[-1:].to(torch.int32),
                      block_m=block_m, num_pairs=P, top_k=K)


def moe_align_torch(topk_ids: torch.Tensor, token_adapter: torch.Tensor | None, num_experts: int,
                    num_slots: int, block_m: int) -> list[tuple[int, int, list[int]]]:
    """Reference: the groups as python lists, [(slot, expert, [pair, ...]), ...] in sorted order."""
    T, K = topk_ids.shape
    groups = []
    adapters = [-1] * T if token_adapter is None or num_slots == 0 else [int(a) for a in token_adapter]
    ids = topk_ids.tolist()
    for slot in range(-1, num_slots):
        for e in range(num_experts):
            pairs = [t * K + k for t in range(T) for k in range(K) if ids[t][k] == e and adapters[t] == slot]
            if pairs:
                groups.append((slot, e, pairs))
    return groups
