"""Timestamped progress lines for long GPU work (a full-width case takes minutes before its first logprob):
written to stderr as they happen, and appended to ``$LPDIFF_CHECK_CSV_DIR/progress.log`` where a job collects its
files, so a run cut off by its deadline still shows which stage took the time."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


def progress_log(tag: str = "", path: str | Path | None = None) -> Callable[[str], None]:
    """A ``log`` for build_case / run_check / References: each line gets the wall clock, the seconds since this
    logger was made and ``tag``. ``path``: the file appended to (default: progress.log in $LPDIFF_CHECK_CSV_DIR,
    none when unset)."""
    t0 = time.monotonic()
    if path is None and os.environ.get("LPDIFF_CHECK_CSV_DIR"):
        path = Path(os.environ["LPDIFF_CHECK_CSV_DIR"]) / "progress.log"
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} +{time.monotonic() - t0:6.1f}s {tag}{msg}"
        print(line, file=sys.stderr, flush=True)
        if path is not None:
            with open(path, "a") as f:
                f.write(line + "\n")

    return log
