"""GPUs shared out among pytest-xdist workers: each worker holds its own GPUs.

With ``pytest -n N`` and cases that need k GPUs each, worker i (``gw<i>``) holds GPUs [i*k, (i+1)*k) of the
machine, through ``CUDA_VISIBLE_DEVICES`` set in the worker before anything starts CUDA (a process reads that
variable once, when CUDA initialises). k is the largest GPU count of the markers the run selects (``-m gpu4`` -> 4;
``-m "gpu1 or gpu2"`` -> 2; no ``-m``: every marker, 8), capped at the machine's count, so ``pytest -n 8 -m gpu1``
on 8 GPUs runs eight workers on eight GPUs and ``pytest -n 2 -m gpu4`` two sets of four. A worker left without a
full set skips its GPU tests, saying so. The machine's GPUs come from an inherited ``CUDA_VISIBLE_DEVICES`` or from
``nvidia-smi -L`` (never from torch: counting through CUDA in the controller or a worker would fix its devices).
Each worker also gets its share of the CPU cores (``OMP_NUM_THREADS``, unless set): N torch processes that each
start one thread per core oversubscribe the host N times over, for themselves and the engine subprocesses they start.

Everything but :func:`configure` is a pure function of its arguments (tested on CPU with fake GPU lists).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import MutableMapping
from dataclasses import dataclass

import pytest

GPU_MARKS = {"gpu1": 1, "gpu2": 2, "gpu4": 4, "gpu8": 8}
ENV = "CUDA_VISIBLE_DEVICES"
THREADS_ENV = "OMP_NUM_THREADS"
HELD_KEY = pytest.StashKey["Assignment | None"]()


@dataclass(frozen=True, slots=True)
class Assignment:
    """What one xdist worker holds: ``held`` out of the machine's ``machine`` GPUs, ``per_worker`` per full set."""

    worker: str
    index: int
    workers: int
    per_worker: int
    machine: tuple[str, ...]
    held: tuple[str, ...]

    def __post_init__(self):
        if not 0 <= self.index < self.workers or self.per_worker < 1:
            raise ValueError(
                f"worker {self.worker}: index {self.index} of {self.workers}, {self.per_worker} per worker"
            )

    def line(self) -> str:
        """The log line of this worker: its id and the devices it holds."""
        held = ",".join(self.held) if self.held else "none"
        return (
            f"{self.worker} -> {ENV}={held} ({self.per_worker} GPU{_s(self.per_worker)} per worker, "
            f"{len(self.machine)} on this machine, -n {self.workers})"
        )


def _s(n: int) -> str:
    return "s" if n != 1 else ""


def parse_nvidia_smi(text: str) -> list[str]:
    """GPU indices from ``nvidia-smi -L`` ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)" per line)."""
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", text, re.MULTILINE)]


def machine_gpus(env: MutableMapping[str, str], smi=None) -> list[str]:
    """The GPUs this process may hand out: an inherited ``CUDA_VISIBLE_DEVICES`` (its entries as written: indices
    or UUIDs) or else ``nvidia-smi -L``'s; none where neither names one (a CPU machine)."""
    if env.get(ENV) is not None:
        return [d.strip() for d in env[ENV].split(",") if d.strip()]
    return parse_nvidia_smi((smi or _nvidia_smi)())


def _nvidia_smi() -> str:
    try:
        run = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):  # no driver: no GPUs to share
        return ""
    return run.stdout if run.returncode == 0 else ""


def gpus_per_case(markexpr: str) -> int:
    """The largest k whose ``gpuK`` marker the ``-m`` expression selects (8 without one); 1 if it selects none."""
    if not markexpr.strip():
        return max(GPU_MARKS.values())
    selected = [n for mark, n in GPU_MARKS.items() if _selects(markexpr, mark)]
    return max(selected, default=1)


def _selects(markexpr: str, mark: str) -> bool:
    """Whether a test carrying only ``mark`` is selected by ``-m markexpr`` (pytest's own evaluator)."""
    from _pytest.mark.expression import Expression

    def matches(name: str, /, **kwargs: object) -> bool:
        return name == mark

    return Expression.compile(markexpr).evaluate(matches)


def worker_index(worker: str) -> int:
    """``gw3`` -> 3 (xdist's worker ids)."""
    m = re.fullmatch(r"gw(\d+)", worker)
    if not m:
        raise ValueError(f"PYTEST_XDIST_WORKER={worker!r} is not an xdist worker id (gw0, gw1, ...)")
    return int(m.group(1))


def assign(machine: list[str], worker: str, workers: int, per_case: int) -> Assignment:
    """Worker i of ``workers`` holds GPUs [i*k, (i+1)*k), k = ``per_case`` capped at the machine's count (a case
    needing more is skipped anyway, and the smaller cases still get a worker); none if that set is not complete."""
    k = max(1, min(per_case, len(machine)))
    i = worker_index(worker)
    held = machine[i * k : (i + 1) * k]
    return Assignment(worker, i, workers, k, tuple(machine), tuple(held) if len(held) == k else ())


def assignments(machine: list[str], workers: int, per_case: int) -> list[Assignment]:
    """Every worker's assignment of a ``-n workers`` run (what the controller logs before the workers start)."""
    return [assign(machine, f"gw{i}", workers, per_case) for i in range(workers)]


def skip_reason(need: int, have: int, held: Assignment | None) -> str | None:
    """Why a case needing ``need`` GPUs cannot run where torch sees ``have`` (None: it can run). In an xdist worker
    the machine's count and the worker's share are named, so a skipped case says which of the two was short."""
    if have >= need:
        return None
    if held is None:
        return f"needs {need} GPU{_s(need)}, this machine has {have}"
    machine = len(held.machine)
    reason = f"needs {need} GPU{_s(need)}, this machine has {machine}"
    if machine < need:
        return reason
    if len(held.held) < need:
        sets = machine // held.per_worker
        return (
            f"{reason}; xdist worker {held.worker} holds {len(held.held)} (-n {held.workers} with "
            f"{held.per_worker} per worker: {sets} full set{_s(sets)})"
        )
    return f"{reason}; xdist worker {held.worker} holds {len(held.held)} but torch sees {have}"


def cpu_share(workers: int, cores: int | None = None) -> int:
    """The CPU threads one of ``workers`` processes gets on a host of ``cores`` (default: this one's)."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, workers))


def configure(env: MutableMapping[str, str], markexpr: str, smi=None, cores: int | None = None) -> Assignment | None:
    """In an xdist worker on a machine with GPUs: pick this worker's GPUs and set ``CUDA_VISIBLE_DEVICES`` in
    ``env``, and ``OMP_NUM_THREADS`` to its share of the cores unless the user set it. None outside xdist or without
    GPUs (the environment is left alone)."""
    worker = env.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    machine = machine_gpus(env, smi)
    if not machine:
        return None
    workers = int(env.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    held = assign(machine, worker, workers, gpus_per_case(markexpr))
    env[ENV] = ",".join(held.held)
    env.setdefault(THREADS_ENV, str(cpu_share(workers, cores)))
    return held


# pytest glue, called from harness/plugin.py's hooks


def on_configure(config) -> None:
    """First thing in a worker's pytest_configure, before any test module can start CUDA. Only a real xdist worker
    (it has ``workerinput``) takes GPUs: a pytest started inside a worker inherits its PYTEST_XDIST_WORKER."""
    if not hasattr(config, "workerinput"):
        config.stash[HELD_KEY] = None
        return
    held = configure(os.environ, config.option.markexpr or "")
    config.stash[HELD_KEY] = held
    if held is not None:
        config.workeroutput["lpdiff_gpus"] = f"{held.line()}, {THREADS_ENV}={os.environ.get(THREADS_ENV)}"


def report_header(config) -> list[str]:
    """The controller's plan, one line per worker (the workers report what they took when they finish)."""
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or workers < 1 or hasattr(config, "workerinput"):
        return []
    machine = machine_gpus(os.environ)
    if not machine:
        return []
    plan = assignments(machine, workers, gpus_per_case(config.option.markexpr or ""))
    return ["lpdiff gpus (plan): " + line.line() for line in plan]


def on_node_down(node) -> None:
    """Log the GPUs a finished worker held: its id and devices, one line."""
    line = getattr(node, "workeroutput", {}).get("lpdiff_gpus")
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(f"lpdiff gpus: {line}")
