"""CUDA graphs of whole calls (forward + log-softmax), cached by the batch's layout.

Why: at full depth the runtime is partly host-bound — ~1000 launches per forward, Triton's Python launch path
~30-75 us each, against ~1.3 ms of GPU work per layer (benchmarks/results/e2e.md). A replayed
graph launches the same kernels with no Python in between.

What a graph may key on: everything the host decides from the batch — prompt lengths (T, cu_seqlens, the padded
attention view, the logprob rows), each prompt's adapter slot (the uniform-slot paths, token_adapter), top-k — is
in the key; only the token ids change between replays, copied into the captured batch's input_ids. The forward has
no host sync and sizes every launch from host-known bounds, which is what makes it capturable.

Policy: a key is captured the second time it is seen (a one-off batch never pays for a capture), and at most
``capacity`` graphs are kept (least recently used out). All graphs share one memory pool: each call reads its
outputs right after its own replay, so a graph may reuse another's intermediates. A key whose capture failed runs
eagerly from then on (warned once)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

SEEN_LIMIT = 1024  # keys remembered as seen once; forgotten wholesale past this (a suite of one-off batches)


class GraphCache:
    def __init__(self, capacity: int, pool: Any = None):
        assert capacity >= 1, "capacity must be >= 1 (0 = no cache: do not build one)"
        self.capacity, self.pool = capacity, pool
        self.graphs: OrderedDict = OrderedDict()
        self.seen: set = set()
        self.refused: set = set()
        self.hits = self.captures = 0

    def get(self, key: Hashable):
        """The cached entry for key (now the most recently used), or None."""
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            self.hits += 1
        return entry

    def want(self, key: Hashable) -> bool:
        """Whether to capture key now: True the second time it is seen (not for refused keys)."""
        if key in self.refused:
            return False
        if key in self.seen:
            return True
        if len(self.seen) >= SEEN_LIMIT:
            self.seen.clear()
        self.seen.add(key)
        return False

    def capture(self, key: Hashable, make: Callable[[], Any]):
        """make() -> an entry (captures and replays once), stored under key; on failure the key is refused and
        None is returned (the caller runs eagerly)."""
        try:
            entry = make()
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this layout eagerly
            self.refused.add(key)
            warnings.warn(
                f"CUDA graph capture failed ({type(e).__name__}: {e}); this batch layout runs eagerly", stacklevel=3
            )
            return None
        self.seen.discard(key)
        self.graphs[key] = entry
        self.captures += 1
        while len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return entry
