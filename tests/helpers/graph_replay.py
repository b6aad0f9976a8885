"""The triton runtime's CUDA graphs against its eager path (gpu1 tests of tests/engines/triton): the same calls
with graphs off and on; on, the second call captures (one capture, no fallback), the later ones replay (counted),
and every call's logprobs, top-k and router margins equal the eager run bit for bit."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.types import ModelSpec
from lpdiff.kernels import faults

FIELDS = ("logprobs", "topk_ids", "topk_logprobs", "router_margin")


def assert_replay_equals_eager(
    spec: ModelSpec,
    adapters: dict,
    dtype: str,
    calls: Sequence[Sequence[Sequence[int]]],
    choice: Sequence[str | None],
    options: dict | None = None,
    fault: str | None = None,
) -> None:
    """``calls``: batches of one layout (the last on other token ids, the graph's only input)."""
    outs = {}
    for graphs in (0, 2):
        opts = {**(options or {}), "cuda_graphs": graphs}
        cfg = EngineConfig(model=spec, adapters=adapters, dtype=dtype, device="cuda", options=opts)
        with warnings.catch_warnings(record=True) as seen, open_engine("triton", cfg) as eng:
            warnings.simplefilter("always")
            with faults.injected(fault) if fault else contextlib.nullcontext():
                outs[graphs] = [eng.prompt_logprobs(p, choice, top_k=3) for p in calls]
            if graphs:
                cache = eng.runtime.graphs
                assert cache is not None, "the runtime built no graph cache"
                assert (cache.captures, cache.hits, len(cache.refused)) == (1, len(calls) - 2, 0)
        assert not [w for w in seen if "graph capture failed" in str(w.message)]
        torch.cuda.empty_cache()
    for i, (e, r) in enumerate(zip(outs[0], outs[2])):
        for x, y in zip(e, r):
            for f in FIELDS:
                assert np.array_equal(getattr(x, f), getattr(y, f)), f"call {i}: {f} differs from the eager run"
    assert not np.array_equal(outs[2][0][0].logprobs, outs[2][-1][0].logprobs), "other ids gave the same logprobs"
