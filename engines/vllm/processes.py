"""vLLM's processes: whether CUDA is usable (asked without poisoning ``fork``), the processes vLLM started, ending
them on close, and tearing down its engine core and process groups so that another ``LLM`` can start here."""

from __future__ import annotations

import contextlib
import os
from typing import Any


def cuda_visible() -> bool:
    """Whether a CUDA GPU is usable, asked through NVML: a plain ``torch.cuda.is_available()`` marks the process so
    that a forked child cannot use CUDA (torch 2.11, measured), and vLLM forks unless told otherwise."""
    import torch

    old = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if old is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = old


def _children() -> dict[int, Any]:
    """This process's descendants, without multiprocessing's resource tracker: spawning vLLM's engine core starts
    one, and it lives as long as this process, so waiting for it on close only burns the close timeout (seen on an
    H200: ~60 s per engine)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:
            continue
        out[p.pid] = p
    return out


def reap(procs: list, timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``procs`` (psutil processes: vLLM's engine core and workers, whose exit is what
    frees the GPU) to end, then kill the ones left. Returns the pids that had to be killed."""
    if not procs:
        return []
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in alive]


def shutdown(llm) -> None:
    """Stop the engine core and tear down vLLM's process groups, so that another LLM can start in this process."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    for obj in (llm, engine, core):
        stop = getattr(obj, "shutdown", None)
        if callable(stop):
            stop()
            break
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except ImportError:
        pass
