"""Where a number came from: the commit and the device, stamped on thresholds, CSV rows and run metadata."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the source tree (or lpdiff/ in a wheel)


def git_commit() -> str:
    """Short HEAD of the checkout lpdiff runs from; ``LPDIFF_COMMIT`` overrides it where there is no git (a copied
    tree on a GPU machine), else "unknown" outside a git checkout."""
    if os.environ.get("LPDIFF_COMMIT"):
        return os.environ["LPDIFF_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str | None = None) -> str:
    """The GPU's name when the work ran (or would run) on CUDA, else "cpu"."""
    import torch

    if (device is None or device.startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"
