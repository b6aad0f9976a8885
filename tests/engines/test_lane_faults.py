"""Faults of a subprocess lane that must end in bounded time: a stopped (SIGSTOP) engine child ends the call at its
default, work-scaled deadline with a LaneDied carrying the log tail; a caller killed with SIGKILL, idle or
mid-call, leaves neither the lane child nor what the engine started behind.

The engine here is a test double (``StoppableEngine``) standing in for an engine that hangs; the lane machinery
(processes, pipes, deadlines, process groups) is the real one.
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

from lpdiff.engines.subprocess_lane import LaneConfig, LaneDied, LaneEngine, work_tokens
from tests.helpers.paths import REPO


class StoppableEngine:
    """Built in the lane child from ``config`` (any picklable object) by LaneEngine."""

    def __init__(self, config):
        print("stoppable: engine built, serving", flush=True)

    def prompt_logprobs(self, prompts, adapter=None, top_k=0):
        return [len(p) for p in prompts]

    def version(self):
        return "stoppable 1"


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pids, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


def test_default_timeouts_are_bounded_and_scale_with_the_work():
    cfg = LaneConfig()
    assert cfg.start_timeout_s <= 15 * 60, "an engine that never comes up must fail in minutes"
    assert cfg.call_timeout(0) == cfg.call_floor_s < float("inf")
    assert cfg.call_timeout(100_000) == pytest.approx(cfg.call_floor_s + 100_000 * cfg.call_per_token_s)
    assert LaneConfig(call_timeout_s=7).call_timeout(10**6) == 7  # an explicit timeout wins
    assert work_tokens(([[1, 2, 3], [4, 5]], None, 0)) == 5 and work_tokens(()) == 0 and work_tokens(("x",)) == 0


def test_stopped_engine_child_ends_the_call_at_its_default_deadline():
    lane_cfg = LaneConfig(start_timeout_s=60, close_timeout_s=5, call_floor_s=2.0, call_per_token_s=0.01)
    prompts = [[1, 2, 3, 4, 5]] * 20  # 100 tokens: deadline 2 + 1 = 3 s, from the defaults' formula
    with LaneEngine("stoppable", "tests.engines.test_lane_faults:StoppableEngine", {"model": "m"}, lane_cfg) as eng:
        assert eng.prompt_logprobs(prompts) == [5] * 20
        pid = eng.lane.info["pid"]
        os.kill(pid, signal.SIGSTOP)  # what a wedged GPU driver call looks like from outside
        t0 = time.monotonic()
        with pytest.raises(LaneDied) as err:
            eng.prompt_logprobs(prompts)
        took = time.monotonic() - t0
    assert 2.9 < took < 6, took
    assert "did not answer within 3 s" in str(err.value) and err.value.returncode is None
    assert "stoppable: engine built, serving" in err.value.log_tail  # the FAIL carries the engine's log
    assert wait_gone([pid], 5) == []


CALLER = textwrap.dedent("""
    import sys, time
    from lpdiff.engines.subprocess_lane import LaneConfig, SubprocessLane
    lane = SubprocessLane("tests.helpers.lane_targets:Doubles", (1.0,), LaneConfig(start_timeout_s=60)).start()
    grandchild = lane.call("spawn_child")
    print(lane.info["pid"], grandchild, flush=True)
    if sys.argv[1] == "mid-call":
        lane.call("hang")
    else:
        time.sleep(600)
""")


@pytest.mark.parametrize("when", ["idle", "mid-call"])
def test_killed_caller_leaves_no_engine_process(when):
    caller = subprocess.Popen([sys.executable, "-c", CALLER, when], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        lane_pid, grandchild = map(int, caller.stdout.readline().split())
        assert not gone(lane_pid) and not gone(grandchild)
        time.sleep(0.3)  # mid-call: the hang has started
        caller.kill()  # SIGKILL: no finally, no atexit in the caller
        caller.wait()
        assert wait_gone([lane_pid, grandchild], 5) == [], "the lane or the engine's own process outlived the caller"
    finally:
        caller.kill()
        caller.wait()
