"""Which slice of each weight one tensor-parallel rank holds (Megatron-style).

Column-parallel (q/k/v, expert gate/up): output rows split, LoRA-A replicated, LoRA-B rows split.
Row-parallel (o, expert down): input columns split, LoRA-A columns split, LoRA-B replicated; partial outputs are
summed by an all-reduce, so biases of row-parallel layers live on rank 0 only.
KV heads are replicated when there are fewer of them than ranks (Qwen3-30B-A3B: 4 kv heads at TP 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lpdiff.harness.spec.errors import InputError


def tp_fix(n: int) -> str:
    """The fix a TP size that does not divide ``n`` heads gets: the sizes that do (a bad --tp is the user's input)."""
    return "use --tp " + " or ".join(str(t) for t in (1, 2, 4, 8) if n % t == 0)


@dataclass(slots=True, frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        assert 0 <= self.rank < self.size

    def split(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's even share of ``dim``."""
        n = t.shape[dim]
        if n % self.size:
            raise ValueError(f"cannot split width {n} evenly over tp={self.size}")
        step = n // self.size
        return t.narrow(dim, self.rank * step, step)

    def split_gate_up(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Gate rows then up rows along ``dim``: this rank's share of each, still gate then up."""
        gate, up = t.chunk(2, dim=dim)
        return torch.cat([self.split(gate, dim), self.split(up, dim)], dim=dim)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        """-> (query heads, kv heads) of this rank."""
        if num_heads % self.size:
            raise InputError(f"{num_heads} attention heads do not split over tp={self.size}; {tp_fix(num_heads)}")
        q = num_heads // self.size
        if num_kv_heads >= self.size:
            if num_kv_heads % self.size:
                raise InputError(f"{num_kv_heads} kv heads do not split over tp={self.size}; {tp_fix(num_kv_heads)}")
            kv = num_kv_heads // self.size
            return range(self.rank * q, (self.rank + 1) * q), range(self.rank * kv, (self.rank + 1) * kv)
        if self.size % num_kv_heads:
            raise ValueError(f"tp={self.size} is not a multiple of the {num_kv_heads} kv heads")
        kv_head = self.rank // (self.size // num_kv_heads)
        return range(self.rank * q, (self.rank + 1) * q), range(kv_head, kv_head + 1)

    def split_qkv(self, t: torch.Tensor, dim: int, num_heads: int, num_kv_heads: int, head_dim: int):
        """Concatenated q|k|v along ``dim`` -> this rank's q|k|v heads (still concatenated)."""
        qh, kvh = self.heads(num_heads, num_kv_heads)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        parts = [(0, qh), (q_size, kvh), (q_size + kv_size, kvh)]
        return torch.cat([t.narrow(dim, off + h.start * head_dim, len(h) * head_dim) for off, h in parts], dim=dim)

    def split_heads(self, t: torch.Tensor, dim: int, num_heads: int, num_kv_heads: int, head_dim: int):
        """Columns of the o projection (or per-head values such as sinks with head_dim=1) of this rank's heads."""
        qh, _ = self.heads(num_heads, num_kv_heads)
        return t.narrow(dim, qh.start * head_dim, len(qh) * head_dim)

    @property
    def first(self) -> bool:
        return self.rank == 0
