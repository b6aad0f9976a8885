"""Issue 44 item 4: killing the caller (SIGKILL: no finally, no atexit) leaves no engine process behind, in every
start phase of a subprocess lane and of triton's tensor-parallel workers — including a lane that is SIGSTOPped or
stuck in C code holding the GIL (a watchdog thread inside it cannot run) and ``lpdiff run --engine triton --tp 2``
killed while its engine starts (a TP worker and multiprocessing's resource tracker outlived it by 700 s).

Every process the caller started, recursively, is recorded just before the kill and must be gone (a zombie counts
as gone: it runs nothing) within GONE_S. The engines are real (triton TP 2 over gloo on the tiny zoo) or test
doubles that hang (tests/helpers/lane_targets.py); processes, pipes, groups and signals are the real ones. Phases
are reached by polling the processes and logs with deadlines, never by fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

GONE_S = 10.0  # "a few seconds" with margin for a loaded 2-core CI machine; the supervisor polls every 0.1 s
PHASE_S = 240.0  # to reach a phase: a cold torch import on a loaded machine


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, command line) of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(d)] = (int(fields[1]), fields[0], cmd)
    return out


def descendants(root: int) -> dict[int, str]:
    table, out, todo = _table(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, state, cmd) in table.items():
            if ppid == parent and pid not in out and state not in ("Z", "X"):
                out[pid] = cmd
                todo.append(pid)
    return out


def alive(pids) -> list[int]:
    table = _table()
    return [p for p in pids if p in table and table[p][1] not in ("Z", "X")]


def wait_for(what: str, cond, within_s: float = PHASE_S, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the caller exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"not reached within {within_s:.0f} s: {what}")


def kill_caller_and_check(caller: subprocess.Popen, min_procs: int) -> float:
    procs = descendants(caller.pid)
    assert len(procs) >= min_procs, procs
    caller.kill()
    caller.wait()
    t0 = time.monotonic()
    while alive(procs) and time.monotonic() - t0 < GONE_S:
        time.sleep(0.05)
    left = {p: procs[p] for p in alive(procs)}
    for p in left:  # never leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"outlived the killed caller by {GONE_S:.0f} s: {left}"
    return time.monotonic() - t0


LANE_CALLER = textwrap.dedent("""
    import sys
    from lpdiff.engines.subprocess_lane import LaneConfig, SubprocessLane
    phase, log, python = sys.argv[1:4]
    lane = SubprocessLane("tests.helpers.lane_targets:Phased", (phase,),
                          LaneConfig(python=python, start_timeout_s=600, log_path=log)).start()
    print(lane.info["pid"], lane.call("spawn_child"), flush=True)
    if phase == "mid-call":
        lane.call("hang")
    elif phase == "gil":
        lane.call("hold_gil")
    else:
        sys.stdin.read()  # idle until killed
""")


def _log_says(log: Path, text: str):
    return lambda: log.exists() and text in log.read_text(errors="replace")


@pytest.mark.parametrize("phase", ["interpreter", "open", "idle", "mid-call", "stopped", "gil"])
def test_killed_caller_leaves_no_lane_process(phase, tmp_path):
    """interpreter: the lane's interpreter is still starting; open: the engine's constructor hangs; idle; mid-call;
    stopped: the lane is SIGSTOPped; gil: the lane blocks in C code holding the GIL."""
    log, python = tmp_path / "lane.log", sys.executable
    if phase == "interpreter":  # an interpreter slow to come up: the lane's process is still a shell sleeping
        python = tmp_path / "slow-python"
        python.write_text(f'#!/bin/sh\nsleep 600\nexec {sys.executable} "$@"\n')
        python.chmod(0o755)
    caller = subprocess.Popen(
        [sys.executable, "-c", LANE_CALLER, phase, str(log), str(python)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if phase == "interpreter":
            wait_for(
                "the slow interpreter",
                lambda: any(c.startswith("sleep 600") for c in descendants(caller.pid).values()),
                proc=caller,
            )
        elif phase == "open":
            wait_for("the engine's constructor", _log_says(log, "lane-target: building (open)"), proc=caller)
        else:
            lane_pid, grandchild = map(int, caller.stdout.readline().split())
            if phase == "mid-call":
                wait_for("the hanging call", _log_says(log, "lane-target: hanging"), proc=caller)
            elif phase == "gil":
                wait_for("the GIL-holding call", _log_says(log, "lane-target: holding the GIL"), proc=caller)
            elif phase == "stopped":
                os.kill(lane_pid, signal.SIGSTOP)
                wait_for("the stopped lane", lambda: _table()[lane_pid][1] == "T")
            assert {lane_pid, grandchild} <= set(descendants(caller.pid))
        kill_caller_and_check(caller, min_procs=2)  # the supervisor and the lane (and the grandchild)
    finally:
        caller.kill()
        caller.wait()


TP_CALLER = textwrap.dedent("""
    import sys, time
    from lpdiff.engines.base import EngineConfig
    from lpdiff.engines.triton import TritonEngine, engine as triton_engine, tp
    from lpdiff.harness.spec.catalog import get_model
    phase = sys.argv[1]

    def hang(what):
        def stuck(*args, **kwargs):
            if what != "rank 0 joins the group" or args[0] == 0:
                print(what, flush=True)
                time.sleep(600)
            return real(*args, **kwargs)
        return stuck

    if phase == "rendezvous":  # the workers wait in init_process_group for rank 0
        real = tp.init_group
        tp.init_group = hang("rank 0 joins the group")
    elif phase == "loading":  # rank 0 joined; the workers load their shards and wait for rank 0
        real = triton_engine.Runtime
        triton_engine.Runtime = hang("rank 0 loads its shard")
    eng = TritonEngine(EngineConfig(model=get_model("tiny-qwen3-moe"), dtype="float32", device="cpu", tp=2))
    eng.start()
    print(eng.prompt_logprobs([[5, 17, 300, 42]])[0].logprobs.shape, "serving", flush=True)
    time.sleep(600)
""")


def _workers(caller: subprocess.Popen) -> list[int]:
    return [p for p, c in descendants(caller.pid).items() if "spawn_main" in c and "resource_tracker" not in c]


@pytest.mark.parametrize("phase", ["spawned", "rendezvous", "loading", "serving", "cli"])
def test_killed_caller_leaves_no_tp_worker_or_resource_tracker(phase, tmp_path):
    """spawned: the worker is still importing torch; rendezvous: it waits in init_process_group; loading: rank 0
    is loading its shard, the worker has loaded its own; serving: the engine runs; cli: `lpdiff run --engine triton
    --tp 2` during its engine start."""
    if phase == "cli":
        argv = [
            sys.executable,
            "-m",
            "lpdiff.harness.cli",
            "run",
            "--model",
            "tiny-qwen3-moe",
            "--adapter",
            "experts",
            "--engine",
            "triton",
            "--tp",
            "2",
        ]
    else:
        argv = [sys.executable, "-c", TP_CALLER, phase]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    caller = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("a TP worker", lambda: _workers(caller), proc=caller)
        if phase == "rendezvous":
            assert caller.stdout.readline().strip() == "rank 0 joins the group"
        elif phase == "loading":
            assert caller.stdout.readline().strip() == "rank 0 loads its shard"
        elif phase == "serving":
            assert caller.stdout.readline().strip().endswith("serving")
        took = kill_caller_and_check(caller, min_procs=1)
        print(f"{phase}: every process gone {took:.2f} s after the kill")
    finally:
        caller.kill()
        caller.wait()
