"""pytest plugin (entry point ``pytest11: lpdiff``).

- markers ``cpu`` and ``gpu1/gpu2/gpu4/gpu8`` (``-m gpu8`` selects the 8-GPU suite); a test whose mark needs more
  GPUs than the machine has is skipped, saying how many it needs and how many there are;
- ``--lpdiff-regen`` (re)writes reference baselines instead of refusing to overwrite them;
  ``--lpdiff-baselines DIR`` picks the store (default: ``$LPDIFF_BASELINES`` or the repo's ``baselines/``);
- fixtures: ``lpdiff_store``, ``lpdiff_regen`` and ``record_verdict`` (adds a verdict to the table printed at the
  end of the run; ``--lpdiff-report FILE`` also writes it as JSON).
"""

from __future__ import annotations

import os
import sys

import pytest

from lpdiff.harness import gpus

GPU_MARKS = gpus.GPU_MARKS
_VERDICTS_KEY = pytest.StashKey[list]()


def pytest_addoption(parser):
    group = parser.getgroup("lpdiff")
    group.addoption(
        "--lpdiff-regen",
        action="store_true",
        default=False,
        help="regenerate reference baselines (overwrites the stored ones)",
    )
    group.addoption(
        "--lpdiff-baselines",
        default=None,
        metavar="DIR",
        help="baseline store directory (default: $LPDIFF_BASELINES or the repo's baselines/)",
    )
    group.addoption("--lpdiff-report", default=None, metavar="FILE", help="write the verdict table as JSON")


def pytest_configure(config):
    gpus.on_configure(config)  # an xdist worker takes its own GPUs before anything starts CUDA
    config.addinivalue_line("markers", "cpu: runs on a CPU-only machine (the default CI suite)")
    for mark, n in GPU_MARKS.items():
        config.addinivalue_line("markers", f"{mark}: needs {n} GPU{'s' if n > 1 else ''} (skipped on fewer)")
    config.stash[_VERDICTS_KEY] = []


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 (a broken CUDA install must not break collection of CPU tests)
        return 0


def pytest_collection_modifyitems(config, items):
    have = None
    for item in items:
        need = max((n for mark, n in GPU_MARKS.items() if item.get_closest_marker(mark)), default=0)
        if not need:
            continue
        have = gpu_count() if have is None else have
        reason = gpus.skip_reason(need, have, config.stash.get(gpus.HELD_KEY, None))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config):
    note = bytecode_note(bool(sys.flags.dont_write_bytecode), _bytecode_cached("torch"))
    return gpus.report_header(config) + ([note] if note else [])


def bytecode_note(dont_write: bool, cached: bool | None) -> str | None:
    """A header line when torch has no bytecode and none will be written: every engine process (lane, TP worker,
    vLLM's model inspection) then compiles torch from source. Images built with ``uv`` (no bytecode unless asked)
    and ``PYTHONDONTWRITEBYTECODE=1`` are like that; ``import torch, transformers`` took 16.7 s there against 6.3 s
    byte-compiled (H100 host), in each of four to seven processes per vLLM case."""
    if not dont_write or cached is not False:
        return None
    return (
        "lpdiff: torch has no bytecode and PYTHONDONTWRITEBYTECODE is set, so every engine process compiles it "
        "from source (~10 s each); byte-compile site-packages once: docs/engines.md, 'Running the GPU suites'"
    )


def _bytecode_cached(package: str) -> bool | None:
    """Whether ``package``'s ``__init__`` has bytecode where this interpreter looks (``PYTHONPYCACHEPREFIX``
    included); None when the package is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return os.path.exists(importlib.util.cache_from_source(spec.origin))


@pytest.fixture(scope="session")
def lpdiff_regen(request) -> bool:
    return bool(request.config.getoption("--lpdiff-regen"))


@pytest.fixture(scope="session")
def lpdiff_store(request):
    from lpdiff.harness.pipeline.references import default_store

    return default_store(request.config.getoption("--lpdiff-baselines"))


@pytest.fixture
def record_verdict(request):
    verdicts = request.config.stash[_VERDICTS_KEY]

    def record(verdict):
        verdicts.append(verdict)
        # junit XML carries each verdict as a <property> of its test case
        request.node.user_properties.append(("lpdiff_verdict", _junit_value(verdict)))
        return verdict

    return record


def _junit_value(v) -> str:
    import json

    got = "PASS" if v.passed else "FAIL"
    return json.dumps(
        {
            "model": v.model,
            "engine_pair": v.engine_pair,
            "dtype": v.dtype,
            "tp": v.tp,
            "adapter": v.adapter,
            "k2": v.metrics.k2,
            "max_abs": v.metrics.max_abs,
            "expected": v.expected,
            "verdict": got,
            "as_expected": got == v.expected,
        },
        default=str,
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    verdicts = config.stash.get(_VERDICTS_KEY, [])
    if not verdicts or hasattr(config, "workerinput"):  # an xdist worker: the controller reports for everyone
        return
    from lpdiff.harness.pipeline.report import verdict_summary, verdict_table
    from lpdiff.harness.pipeline.verdict import to_json

    terminalreporter.section("lpdiff verdicts")
    terminalreporter.write_line(verdict_table(verdicts))
    terminalreporter.write_line(verdict_summary(verdicts))
    if summary := os.environ.get("GITHUB_STEP_SUMMARY"):  # GitHub Actions renders this markdown on the run page
        with open(summary, "a") as f:
            f.write(f"### lpdiff verdicts\n\n{verdict_summary(verdicts)}\n\n{verdict_table(verdicts, 'github')}\n")
    path = config.getoption("--lpdiff-report")
    if path:
        with open(path, "w") as f:
            f.write(to_json(verdicts))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Collect verdicts from xdist workers so the table covers the whole run."""
    gpus.on_node_down(node)
    data = getattr(node, "workeroutput", {}).get("lpdiff_verdicts")
    if data:
        from lpdiff.harness.pipeline.verdict import from_json

        node.config.stash[_VERDICTS_KEY].extend(from_json(data))


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # this is an xdist worker: ship verdicts to the controller
        from lpdiff.harness.pipeline.verdict import to_json

        workeroutput["lpdiff_verdicts"] = to_json(session.config.stash.get(_VERDICTS_KEY, []))
