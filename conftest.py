"""Repo-level pytest setup. The lpdiff plugin itself (markers, GPU skips, --lpdiff-regen, verdict table) is
registered through the ``pytest11`` entry point of the installed package (harness/plugin.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one torch thread each instead of both fighting over both cores.
    import torch

    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: minutes on CI's 2 cores; README's `pytest -n 2` leaves it out, .ci/run runs it as its own "
        "stage (`pytest -m slow`); any -m expression, or naming the test, selects it again",
    )


def pytest_collection_modifyitems(config, items):
    """Without -m, leave out tests marked slow so README's `python -m pytest -n 2` fits CI's 10 minutes on 2 cores
    (issue 41). A test named on the command line (path::name) still runs: asking for it is asking for it."""
    if config.option.markexpr:
        return
    named = tuple(a for a in config.args if "::" in a)
    keep, slow = [], []
    for item in items:
        if item.get_closest_marker("slow") and not item.nodeid.startswith(named or ("\0",)):
            slow.append(item)
        else:
            keep.append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep
