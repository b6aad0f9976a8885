"""Starting vLLM's ``LLM`` on a GPU that other processes share.

vLLM 0.25.1 measures free GPU memory before and after its profile run and asserts that it did not rise
(v1/worker/gpu_worker.py, determine_available_memory): another process on the GPU that frees memory meanwhile kills
the start. lpdiff runs several engines on one GPU (its reference in this process or beside it), and on an H200 a
vLLM lane died so: "Error in memory profiling. Initial free memory 88.19 GiB, current free memory 96.71 GiB. This
happens when other processes sharing the same container release GPU memory while vLLM is profiling during
initialization." That start, and no other failure, is retried after a pause, once what it left is freed."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

from lpdiff.engines.vllm.processes import _children, reap, shutdown

# the start of vLLM's assertion message for free memory that rose during profiling (0.25.1; older releases too)
PROFILE_RACE = "Error in memory profiling. Initial free memory"
RETRIES = 2
PAUSE_S = 10.0  # lets the other process finish freeing, so the next profile run measures a settled GPU
REAP_S = 30.0  # how long a failed start's engine core and workers get to exit before they are killed


def profile_race(exc: BaseException) -> str | None:
    """The first sentence of vLLM's memory-profiling assertion where ``exc`` is it or was raised from it (a TP
    worker's failure re-raised by the executor keeps it in its cause); None for any other failure."""
    for e in _chain(exc):
        text = str(e)
        if PROFILE_RACE in text:
            return text[text.index(PROFILE_RACE) :].split(" This happens")[0]
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def start_llm(
    llm_cls: Callable[..., Any],
    kwargs: dict[str, Any],
    log: Callable[[str], None] | None = None,
    retries: int = RETRIES,
    pause_s: float = PAUSE_S,
) -> tuple[Any, list]:
    """``llm_cls(**kwargs)`` and the processes it started (psutil processes: engine core, TP workers). A start that
    vLLM's memory profiler refused because GPU memory was freed meanwhile is retried up to ``retries`` times, each
    after the failed start's processes have exited, vLLM's process groups are torn down and this process's cached
    GPU memory is released, and ``pause_s``; ``log`` gets one line per retry. Any other failure propagates."""
    if log is None:
        from lpdiff.engines.progress import progress_log

        log = progress_log("[vllm] ")
    for attempt in range(1, retries + 2):
        before = set(_children())
        try:
            llm = llm_cls(**kwargs)
        except Exception as e:
            why = profile_race(e)
            if why is None or attempt > retries:
                raise
            for link in _chain(e):  # the tracebacks' frames hold the half-built engine (its weights on the GPU)
                link.__traceback__ = None
        else:
            return llm, [p for pid, p in _children().items() if pid not in before]
        log(
            f"vLLM refused to start: {why} (another process freed GPU memory during its profile run); retry "
            f"{attempt} of {retries} in {pause_s:g} s"
        )
        _free_failed_start(before)
        time.sleep(pause_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _free_failed_start(before: set[int]) -> None:
    gc.collect()
    reap([p for pid, p in _children().items() if pid not in before], REAP_S)
    shutdown(None)  # no LLM to stop: tears down the process groups the failed start initialised
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
