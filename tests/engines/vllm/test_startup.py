"""engines/vllm/startup.py: a vLLM start that its memory profiler refused because another process freed GPU memory
meanwhile is retried, after what it left is freed (its half-built engine collected, the processes it started ended);
any other start failure propagates at once. Also through VLLMEngine.__enter__."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import weakref
from typing import ClassVar

import pytest

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.vllm import startup
from lpdiff.engines.vllm.engine import VLLMEngine
from lpdiff.engines.vllm.startup import start_llm
from lpdiff.harness.types import ModelSpec

# what vLLM 0.25.1 raised on an H200 (gpu_worker.py determine_available_memory)
H200_RACE = (
    "Error in memory profiling. Initial free memory 88.19 GiB, current free memory 96.71 GiB. This happens when "
    "other processes sharing the same container release GPU memory while vLLM is profiling during initialization. "
    "To fix this, ensure consistent GPU memory allocation or isolate vLLM in its own container."
)


class Weights:
    """What a half-built engine holds (its GPU weights, here a plain object whose collection is observable)."""


def stand_in_llm(failures: list[BaseException], child: bool = False):
    """A stand-in for vllm.LLM, which needs vLLM and a GPU another process frees memory on: each start raises the
    next of ``failures`` (a half-built engine left in the traceback, and with ``child`` a process it started, as
    vLLM's engine core) and then succeeds. The class records its starts, the weights of every start and the
    processes the failed ones left."""

    class LLM:
        starts: ClassVar[list[dict]] = []
        weights: ClassVar[list[weakref.ref]] = []
        children: ClassVar[list[subprocess.Popen]] = []

        def __init__(self, **kwargs):
            # a start begins only once the failed one's weights were collected
            assert all(w() is None for w in LLM.weights), "the failed start's engine was not freed"
            LLM.starts.append(kwargs)
            self.weights = Weights()
            LLM.weights.append(weakref.ref(self.weights))
            if len(LLM.starts) <= len(failures):
                if child:
                    LLM.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
                raise failures[len(LLM.starts) - 1]

    return LLM


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(startup, "REAP_S", 0.5)
    lines: list[str] = []
    return dict(log=lines.append, pause_s=0.01), lines


def test_profile_race_is_retried_after_freeing_the_failed_start(fast):
    kw, lines = fast
    LLM = stand_in_llm([AssertionError(H200_RACE)], child=True)
    llm, procs = start_llm(LLM, {"model": "m"}, **kw)
    assert isinstance(llm, LLM) and LLM.starts == [{"model": "m"}, {"model": "m"}] and procs == []
    assert len(lines) == 1 and "88.19 GiB" in lines[0] and "retry 1 of 2" in lines[0], lines
    assert "This happens" not in lines[0]  # one line: vLLM's first sentence
    (child,) = LLM.children
    assert child.wait(timeout=10) is not None  # the failed start's process was ended before the retry


def test_race_raised_from_a_worker_failure_is_retried(fast):
    kw, lines = fast
    try:
        raise AssertionError(H200_RACE)
    except AssertionError as e:
        try:
            raise RuntimeError("Worker failed with error, please check the stack trace above") from e
        except RuntimeError as wrapped:
            worker = wrapped
    LLM = stand_in_llm([worker])
    start_llm(LLM, {}, **kw)
    assert len(LLM.starts) == 2 and len(lines) == 1


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory"),
        # vLLM's other profiling assertion (used memory did not grow): not another process freeing memory
        AssertionError("Error in memory profiling. Initial used memory 1, currently used memory 0."),
        ValueError("No available memory for the cache blocks"),
    ],
)
def test_other_start_failures_propagate_at_once(fast, error):
    kw, lines = fast
    LLM = stand_in_llm([error])
    with pytest.raises(type(error)) as got:
        start_llm(LLM, {}, **kw)
    assert got.value is error and len(LLM.starts) == 1 and lines == []


def test_a_lasting_race_fails_after_the_retries(fast):
    kw, lines = fast
    LLM = stand_in_llm([AssertionError(H200_RACE)] * 3)
    with pytest.raises(AssertionError, match=r"Initial free memory 88\.19 GiB"):
        start_llm(LLM, {}, retries=2, **kw)
    assert len(LLM.starts) == 3 and len(lines) == 2


def test_engine_start_retries_the_race(fast, monkeypatch, tmp_path):
    """VLLMEngine.__enter__ builds LLM through start_llm: the stand-in replaces vLLM's module and the kwargs vLLM's
    EngineArgs would check (vLLM is not installed here)."""
    _, lines = fast
    LLM = stand_in_llm([AssertionError(H200_RACE)])
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # __enter__ sets vLLM's variables: gone after the test
    monkeypatch.setattr(VLLMEngine, "_llm_kwargs", lambda self, on_cpu: {"model": "m"})
    monkeypatch.setattr(VLLMEngine, "_lora_requests", lambda self: {})
    monkeypatch.setattr(startup, "start_llm", _logging_to(startup.start_llm, lines.append))
    eng = VLLMEngine(EngineConfig(model=ModelSpec("t", "qwen3", path=str(tmp_path)), device="cpu"))
    with eng:
        assert isinstance(eng.llm, LLM) and len(LLM.starts) == 2 and len(lines) == 1
    assert eng.llm is None

    Other = stand_in_llm([RuntimeError("engine core died")])
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=Other))
    with pytest.raises(RuntimeError, match="engine core died"):
        VLLMEngine(EngineConfig(model=ModelSpec("t", "qwen3", path=str(tmp_path)), device="cpu")).__enter__()
    assert len(Other.starts) == 1 and len(lines) == 1


def _logging_to(start, log):
    def call(llm_cls, kwargs, **kw):
        return start(llm_cls, kwargs, log=log, pause_s=0.01, **kw)

    return call
