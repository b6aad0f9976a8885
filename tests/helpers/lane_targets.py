"""Engines built inside a lane child by the kill-the-caller tests (tests/engines/test_integrity_orphans.py): each says
in the lane log which state it reached, then stays there (a hang in its constructor, a call that sleeps, a grandchild of
its own, a call that holds the GIL in C code), and the lane tests' ``Doubles`` (tests/engines/vllm/test_lane.py).
Test doubles for engines that hang, fail or die; the lane machinery is real."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import numpy as np


class Phased:
    def __init__(self, phase: str):
        print(f"lane-target: building ({phase})", flush=True)
        if phase == "open":
            time.sleep(600)  # an engine that never finishes starting

    def spawn_child(self) -> int:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid

    def hang(self) -> None:
        print("lane-target: hanging", flush=True)
        time.sleep(600)

    def hold_gil(self) -> None:
        print("lane-target: holding the GIL", flush=True)
        # PyDLL calls keep the GIL: no thread of this process runs Python while libc's sleep() blocks
        ctypes.PyDLL(None).sleep(600)


class Doubles:
    """Built in the child by target 'tests.helpers.lane_targets:Doubles' (tests/engines/vllm/test_lane.py,
    tests/engines/test_lane_faults.py): an engine whose calls echo, raise, kill their process, hang or spawn."""

    def __init__(self, scale: float):
        self.scale = scale
        self.entered = False

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc):
        print("double: exit", flush=True)

    def echo(self, x):
        return {"arr": np.asarray(x, dtype=np.float32) * self.scale, "entered": self.entered, "pid": os.getpid()}

    def fail(self):
        raise ValueError("adapter rank 64 > max_lora_rank 16")

    def die(self):
        # what SGLang 0.5.15 does on a PEFT 3D adapter: log, then the process is killed
        print("Loading LoRA weights: skipped 96 expert tensors", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def hang(self):
        time.sleep(600)

    def spawn_child(self):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
