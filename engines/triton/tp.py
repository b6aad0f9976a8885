"""Tensor parallelism started by the engine itself: rank 0 is the engine's own process, ranks 1..tp-1 are
spawned workers that load their shard, then wait for broadcast work until told to stop. The same code path runs
from pytest and the CLI. NCCL on GPUs (one GPU per rank), gloo on CPU (a real test of the sharding math)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist

from lpdiff.engines import supervise
from lpdiff.engines.triton.options import TritonOptions
from lpdiff.engines.triton.runtime import Runtime
from lpdiff.engines.triton.shard import Shard
from lpdiff.kernels import faults

# NVLink multicast can take a shared host's GPUs out of service; it stays off in every process we start.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def all_reduce_fn(world: int):
    if world == 1:
        return lambda x: x

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    return all_reduce


def broadcast(obj=None):
    """Rank 0's ``obj`` to every rank (workers pass None and receive it)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def init_group(rank: int, world: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    os.environ.update(SAFE_ENV)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def worker_main(rank: int, world: int, init_method: str, config, device: torch.device, options: TritonOptions, queue):
    try:
        faults.activate(options.fault)
        device = rank_device(device, rank)
        queue.put((rank, "started", None))
        init_group(rank, world, init_method, device, options.timeout_s)
        runtime = Runtime(config, options, Shard(rank, world), device, all_reduce_fn(world))
        queue.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 (whatever stops a worker starting, the parent is told and re-raises it)
        queue.put((rank, "error", traceback.format_exc()))
        return
    while (msg := broadcast()) is not None:  # a run's arguments, or a callable work item (capture.CaptureWork)
        if callable(msg):
            msg(runtime)
        else:
            runtime.run(*msg)
    dist.destroy_process_group()


class Workers:
    """Ranks 1..world-1 of one engine. ``start`` returns once they joined the process group; ``wait_ready``
    once they loaded their shards (or raises with the first worker's traceback)."""

    def __init__(self, world: int, config, device: torch.device, options: TritonOptions):
        self.world, self.timeout_s = world, options.timeout_s
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.init_method = f"tcp://127.0.0.1:{port}"
        os.environ.update(SAFE_ENV)  # inherited by the spawned workers
        ctx = torch.multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        # Each worker dies with this process (supervise.guarded: PR_SET_PDEATHSIG, before it imports torch), so a
        # killed caller leaves no worker blocked in a collective for timeout_s, nor multiprocessing's resource
        # tracker (it exits once every holder of its pipe is gone).
        me = os.getpid()
        self.procs = [
            ctx.Process(
                target=supervise.guarded,
                daemon=True,
                args=(
                    me,
                    pickle.dumps((worker_main, (r, world, self.init_method, config, device, options))),
                    self.queue,
                ),
            )
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        self._wait("started")

    def _wait(self, state: str) -> None:
        pending = set(range(1, self.world))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            try:
                rank, got, tb = self.queue.get(timeout=1.0)
            except Empty:  # nothing within the second: check the workers are still alive
                dead = [r for r, p in zip(range(1, self.world), self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.stop(force=True)
                    why = f"died (exit codes {[self.procs[r - 1].exitcode for r in dead]})" if dead else "timed out"
                    raise RuntimeError(
                        f"tensor-parallel workers {dead or sorted(pending)} {why} before reaching '{state}'"
                    ) from None
                continue
            if got == "error":
                self.stop(force=True)
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{tb}")
            if got == state:
                pending.discard(rank)

    def wait_ready(self) -> None:
        self._wait("ready")

    def stop(self, force: bool = False) -> None:
        for p in self.procs:
            p.join(timeout=0 if force else 60)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
