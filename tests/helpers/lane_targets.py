"""Engines built inside a lane child by the kill-the-caller tests (tests/engines/test_integrity_orphans.py): each says
in the lane log which state it reached, then stays there (a hang in its constructor, a call that sleeps, a grandchild of
its own, a call that holds the GIL in C code). Test doubles for engines that hang; the lane machinery is real."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time


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
