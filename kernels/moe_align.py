"""Routing alignment for grouped GEMMs: sort (token, expert) pairs into (expert, adapter slot) groups and pad every
group to the GEMM block size, so that each block of BLOCK_M rows has one expert and one adapter slot.

Groups are ordered expert-major (expert 0: no adapter, slot 0, slot 1, ...; then expert 1, ...): the blocks of one
expert under different adapters are neighbours, run at the same time under the GEMMs' GROUP_M ordering and share
that expert's weight tiles through L2. Slot-major order would stream every expert's weights once per adapter
(measured on an H100 at T=512 with 4 adapters: about 3x slower, benchmarks/results/kernels.md).

Shapes: T tokens, K top-k, E experts, L adapter slots, P = T*K pairs, G = E*(L+1) groups (slot -1 = no adapter
first within an expert), M_max = padded row capacity, NB = M_max / BLOCK_M blocks.

Everything stays on the device: the capacity is an upper bound known from shapes alone, and the number of rows
actually used (num_padded) is a device tensor that the kernels read, so no host synchronisation happens.

Two implementations: torch ops (about fifteen small launches, pairs in stable order) and three Triton kernels
(count with atomics on SUBS sub-counters per group, prefix sum, fill). The Triton one places pairs inside a group
in arrival order of the atomics, which varies between runs; the GEMM rows are independent, so the layer's output
does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lpdiff.kernels._triton import dual_jit, resolve_impl, tl, triton


@dataclass(slots=True)
class MoeRouting:
    sorted_ids: torch.Tensor  # (M_max,) int32 pair index t*K+k per padded row; P marks a padding row
    block_expert: torch.Tensor  # (NB,) int32 expert of each block
    block_adapter: torch.Tensor  # (NB,) int32 adapter slot of each block, -1 = none
    num_padded: torch.Tensor  # (1,) int32 rows in use (a multiple of block_m); blocks past it are idle
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


def moe_align(
    topk_ids: torch.Tensor | None,
    token_adapter: torch.Tensor | None,
    num_experts: int,
    num_slots: int,
    block_m: int,
    impl: str = "auto",
    num_tokens: int | None = None,
    device=None,
) -> MoeRouting:
    """topk_ids (T, K) int, token_adapter (T,) int (slot, -1 = none) or None -> MoeRouting.
    Dense layers pass topk_ids=None with num_tokens and device: one expert, K = 1."""
    if topk_ids is None:
        assert num_tokens is not None and device is not None, "topk_ids=None needs num_tokens and device"
        dev = torch.device(device)
        if resolve_impl(impl, dev) == "triton":
            return moe_align_triton(None, token_adapter, num_experts, num_slots, block_m, num_tokens, dev)
        topk_ids = torch.zeros(num_tokens, 1, dtype=torch.int32, device=dev)
    elif resolve_impl(impl, topk_ids.device) == "triton":
        return moe_align_triton(topk_ids, token_adapter, num_experts, num_slots, block_m)
    return moe_align_torch(topk_ids, token_adapter, num_experts, num_slots, block_m)


def moe_align_torch(
    topk_ids: torch.Tensor, token_adapter: torch.Tensor | None, num_experts: int, num_slots: int, block_m: int
) -> MoeRouting:
    """torch ops; pairs keep their original order inside a group (stable sort)."""
    assert topk_ids.ndim == 2, f"topk_ids must be (T, K), got {tuple(topk_ids.shape)}"
    T, K = topk_ids.shape
    dev = topk_ids.device
    P, E = T * K, num_experts
    S1 = num_slots + 1 if token_adapter is not None and num_slots > 0 else 1
    G = E * S1
    ids = topk_ids.reshape(-1).long()
    if S1 == 1:
        gid = ids
    else:
        assert token_adapter is not None  # S1 > 1 only with slots
        assert token_adapter.shape == (T,), f"token_adapter must be ({T},), got {tuple(token_adapter.shape)}"
        slot = token_adapter.long().clamp(min=-1).repeat_interleave(K)
        gid = ids * S1 + slot + 1
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
    return MoeRouting(
        sorted_ids=sorted_ids,
        block_expert=(block_gid // S1).to(torch.int32),
        block_adapter=(block_gid % S1 - 1).to(torch.int32),
        num_padded=pad_end[-1:].to(torch.int32),
        block_m=block_m,
        num_pairs=P,
        top_k=K,
    )


def align_groups_reference(
    topk_ids: torch.Tensor, token_adapter: torch.Tensor | None, num_experts: int, num_slots: int
) -> list[tuple[int, int, list[int]]]:
    """Reference: the groups as python lists, [(slot, expert, [pair, ...]), ...] in sorted order (expert-major)."""
    T, K = topk_ids.shape
    groups = []
    adapters = [-1] * T if token_adapter is None or num_slots == 0 else [int(a) for a in token_adapter]
    ids = topk_ids.tolist()
    for e in range(num_experts):
        for slot in range(-1, num_slots):
            pairs = [t * K + k for t in range(T) for k in range(K) if ids[t][k] == e and adapters[t] == slot]
            if pairs:
                groups.append((slot, e, pairs))
    return groups


# ------------------------------------------------------------------------------------------------ Triton version


@triton.jit
def _group_ids(TopkIds, TokenAdapter, offs, ok, S1, TOPK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Group of each pair: expert * S1 + slot + 1, S1 = slots + 1 (1 without adapters)."""
    gid = tl.zeros_like(offs)
    if HAS_IDS:
        gid = tl.load(TopkIds + offs, mask=ok, other=0).to(tl.int32)
    if HAS_SLOTS:
        slot = tl.maximum(tl.load(TokenAdapter + offs // TOPK, mask=ok, other=-1).to(tl.int32), -1)
        gid = gid * S1 + slot + 1
    return gid


@dual_jit
def _align_count_kernel(
    TopkIds,
    TokenAdapter,
    Counts,
    Pos,
    num_pairs,
    S1,
    TOPK: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SUBS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    gid = _group_ids(TopkIds, TokenAdapter, offs, ok, S1, TOPK, HAS_IDS, HAS_SLOTS)
    # old value = place inside the (group, sub-counter); program pid counts on sub-counter pid % SUBS
    pos = tl.atomic_add(Counts + gid * SUBS + pid % SUBS, 1, mask=ok, sem="relaxed")
    tl.store(Pos + offs, pos, mask=ok)


@dual_jit
def _align_offsets_kernel(
    Counts,
    SubStart,
    GroupCount,
    GroupStart,
    GroupEnd,
    NumPadded,
    G,
    BLOCK_M: tl.constexpr,
    G_PAD: tl.constexpr,
    SUBS: tl.constexpr,
):
    g = tl.arange(0, G_PAD)
    sub = tl.arange(0, SUBS)
    idx = g[:, None] * SUBS + sub[None, :]
    c = tl.load(Counts + idx, mask=(g < G)[:, None], other=0)  # (G_PAD, SUBS)
    total = tl.sum(c, axis=1)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    # each sub-counter's pairs follow the previous ones' inside their group
    tl.store(SubStart + idx, start[:, None] + tl.cumsum(c, 1) - c, mask=(g < G)[:, None])
    tl.store(GroupCount + g, total, mask=g < G)
    tl.store(GroupStart + g, start, mask=g < G)
    tl.store(GroupEnd + g, end, mask=g < G)
    tl.store(NumPadded, tl.sum(padded, 0))


@dual_jit
def _align_fill_kernel(
    TopkIds,
    TokenAdapter,
    GroupCount,
    SubStart,
    Pos,
    GroupStart,
    GroupEnd,
    SortedIds,
    BlockExpert,
    BlockAdapter,
    num_pairs,
    S1,
    G,
    m_max,
    row_programs,
    TOPK: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    SUBS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < row_programs:
        # padding rows and block tables: each row finds its group by binary search over the group ends
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        ok = rows < m_max
        lo = tl.zeros_like(rows)
        hi = tl.zeros_like(rows) + G
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(GroupEnd + tl.minimum(mid, G - 1)) <= rows
            active = lo < hi
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        g = tl.minimum(lo, G - 1)  # rows past num_padded: any group, those blocks are never run
        is_pad = (rows - tl.load(GroupStart + g)) >= tl.load(GroupCount + g)
        tl.store(SortedIds + rows, num_pairs + tl.zeros_like(rows), mask=ok & is_pad)
        first = ok & (rows % BLOCK_M == 0)
        tl.store(BlockExpert + rows // BLOCK_M, g // S1, mask=first)
        tl.store(BlockAdapter + rows // BLOCK_M, g % S1 - 1, mask=first)
    else:
        cpid = pid - row_programs  # the count kernel's program over these pairs (same BLOCK)
        offs = cpid * BLOCK + tl.arange(0, BLOCK)
        ok = offs < num_pairs
        gid = _group_ids(TopkIds, TokenAdapter, offs, ok, S1, TOPK, HAS_IDS, HAS_SLOTS)
        dest = tl.load(SubStart + gid * SUBS + cpid % SUBS, mask=ok, other=0) + tl.load(Pos + offs, mask=ok, other=0)
        tl.store(SortedIds + dest, offs, mask=ok)


# sub-counters per group in the count kernel: its atomics on one address serialise in L2, and at Qwen3-30B-A3B's
# shape (T 4096, top-8, 128 experts) one counter per group took 256 of them: 13.9 us per layer on an H200
SUBS = 8


def moe_align_triton(
    topk_ids: torch.Tensor | None,
    token_adapter: torch.Tensor | None,
    num_experts: int,
    num_slots: int,
    block_m: int,
    num_tokens: int | None = None,
    device=None,
) -> MoeRouting:
    if topk_ids is not None:
        dev, (T, K) = topk_ids.device, topk_ids.shape
    else:
        assert num_tokens is not None, "topk_ids=None needs num_tokens"
        dev, T, K = torch.device(device), num_tokens, 1
    has_slots = token_adapter is not None and num_slots > 0
    P, E = T * K, num_experts
    S1 = num_slots + 1 if has_slots else 1
    G = E * S1
    m_max = max_padded_rows(P, G, block_m)
    # one allocation carved into the ten int32 arrays: the runtime is host-bound at full depth, and each
    # allocation is a few microseconds of Python per layer
    sizes = (G * SUBS, G * SUBS, G, P, G, G, 1, m_max, m_max // block_m, m_max // block_m)
    buf = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
    counts, sub_start, group_count, pos, start, end, num_padded, sorted_ids, block_expert, block_adapter = buf.split(
        sizes
    )
    counts.zero_()
    ids = topk_ids.contiguous() if topk_ids is not None else counts  # unread when absent (HAS_IDS=False)
    ta = token_adapter.contiguous() if token_adapter is not None and has_slots else counts
    BLOCK = 1024 if dev.type == "cuda" else 256
    flags = dict(TOPK=K, HAS_IDS=topk_ids is not None, HAS_SLOTS=has_slots, BLOCK=BLOCK, SUBS=SUBS)
    _align_count_kernel[(triton.cdiv(P, BLOCK),), dev](ids, ta, counts, pos, P, S1, **flags)
    _align_offsets_kernel[(1,), dev](
        counts,
        sub_start,
        group_count,
        start,
        end,
        num_padded,
        G,
        BLOCK_M=block_m,
        G_PAD=triton.next_power_of_2(G),
        SUBS=SUBS,
    )
    row_programs = triton.cdiv(m_max, BLOCK)
    _align_fill_kernel[(row_programs + triton.cdiv(P, BLOCK),), dev](
        ids,
        ta,
        group_count,
        sub_start,
        pos,
        start,
        end,
        sorted_ids,
        block_expert,
        block_adapter,
        P,
        S1,
        G,
        m_max,
        row_programs,
        BLOCK_M=block_m,
        SEARCH_STEPS=G.bit_length(),
        **flags,
    )
    return MoeRouting(
        sorted_ids=sorted_ids,
        block_expert=block_expert,
        block_adapter=block_adapter,
        num_padded=num_padded,
        block_m=block_m,
        num_pairs=P,
        top_k=K,
    )
