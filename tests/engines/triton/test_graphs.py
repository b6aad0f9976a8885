"""The CUDA-graph cache's policy (engines/triton/graphs.py) on the host: capture on a layout's second sighting, LRU
capacity, a failed capture refused for good. The capture itself needs CUDA: tests/engines/triton/test_engine_gpu.py
(test_cuda_graph_replay_equals_eager) compares replays with the eager forward bit for bit."""

from __future__ import annotations

import pytest
import torch

from lpdiff.engines.triton.graphs import GraphCache


def test_second_sighting_captures_and_hits_count():
    c = GraphCache(2)
    assert c.get("a") is None and not c.want("a")  # first sighting: eager, remembered
    assert c.want("a")  # second: capture
    assert c.capture("a", lambda: "graph-a") == "graph-a"
    assert c.get("a") == "graph-a" and c.get("a") == "graph-a"
    assert (c.captures, c.hits) == (1, 2)


def test_capacity_drops_the_least_recently_used():
    c = GraphCache(2)
    for k in "abc":
        c.want(k)
    c.capture("a", lambda: 1)
    c.capture("b", lambda: 2)
    c.get("a")  # a is now more recent than b
    c.capture("c", lambda: 3)
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3


def test_failed_capture_is_refused_for_good():
    c = GraphCache(1)
    c.want("k")

    def boom():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(UserWarning, match="runs eagerly"):
        assert c.capture("k", boom) is None
    assert not c.want("k") and not c.want("k")


def test_engine_option_is_checked_and_cpu_runs_without_graphs():
    from lpdiff.engines.base import EngineConfig
    from lpdiff.engines.triton import TritonEngine
    from lpdiff.harness.spec.catalog import get_model

    spec = get_model("tiny-qwen3-moe")
    with pytest.raises(ValueError, match="cuda_graphs"):
        TritonEngine(EngineConfig(model=spec, dtype="float32", device="cpu", options={"cuda_graphs": -1}))
    with TritonEngine(EngineConfig(model=spec, dtype="float32", device="cpu", options={"cuda_graphs": 2})) as eng:
        assert eng.runtime.graphs is None  # CPU: no graphs, the eager path
        a = eng.prompt_logprobs([[1, 2, 3, 4], [5, 6]])
        b = eng.prompt_logprobs([[1, 2, 3, 4], [5, 6]])
    assert all(torch.equal(torch.from_numpy(x.logprobs), torch.from_numpy(y.logprobs)) for x, y in zip(a, b))
