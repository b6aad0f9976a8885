"""Repo-level pytest setup. The lpdiff plugin itself (markers, GPU skips, --lpdiff-regen, verdict table) is
registered through the ``pytest11`` entry point of the installed package (harness/plugin.py)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one torch thread each instead of both fighting over both cores.
    import torch

    torch.set_num_threads(1)
