"""gpu1 kernel tests' two CUDA checks: a launch captured in a CUDA graph replays to its eager bits, and a launch's
time by CUDA events (eager launches back to back: launch overhead included, so a small kernel reads slower here than
in a replayed forward's profile)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured_equals_eager(fn: Callable, eager) -> None:
    """fn() (a tensor or a tuple of them), captured after one warm-up launch, replays to ``eager`` bit for bit."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    pairs = zip(captured, eager, strict=True) if isinstance(captured, tuple | list) else [(captured, eager)]
    for c, e in pairs:
        assert torch.equal(c, e)


def launch_us(fn: Callable, reps: int = 20) -> float:
    """Mean microseconds of fn() over ``reps`` eager launches after a warm-up one."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3
