"""Engine sessions: open an engine once, run the whole mixed batch (every prompt with every adapter choice) in one
call the way a serving engine sees it, and return one LogprobRun per choice. Every command goes through here."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.harness.pipeline.provenance import device_name
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import AdapterSpec, LogprobRun, ModelSpec

Lanes = dict[str | None, LogprobRun]  # adapter name (None = base) -> run


@dataclass(slots=True)
class SessionRuns:
    """What one engine session produced: ``runs[j]`` is the j-th pass over the mixed batch (reruns measure the
    engine's own noise), keyed by adapter name (None = base)."""

    engine: str
    version: str
    runs: list[Lanes] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def first(self) -> Lanes:
        return self.runs[0]


def mixed_batch(
    eng, prompts: Sequence[Sequence[int]], choices: Sequence[str | None], top_k: int = 0, meta: dict | None = None
) -> Lanes:
    """Every prompt once per adapter choice (None = base), all in one call of an open engine."""
    flat = eng.prompt_logprobs(
        [p for _ in choices for p in prompts], adapter=[c for c in choices for _ in prompts], top_k=top_k
    )
    n = len(prompts)
    return {c: LogprobRun(flat[i * n : (i + 1) * n], {**(meta or {}), "adapter": c}) for i, c in enumerate(choices)}


def run_session(
    engine: str,
    spec: ModelSpec,
    adapters: dict[str, AdapterSpec],
    prompts: Sequence[Sequence[int]],
    dtype: str,
    tp: int = 1,
    top_k: int = 0,
    options: dict | None = None,
    reruns: int = 1,
) -> SessionRuns:
    """One engine session: the mixed batch (base + every adapter) ``reruns`` times. Each run's metadata says what
    produced it (engine, version, dtype, TP, model, device, wall time)."""
    cfg = EngineConfig(model=spec, adapters=dict(adapters), dtype=dtype, tp=tp, options=dict(options or {}))
    choices: list[str | None] = [None, *adapters]
    out = SessionRuns(engine, "?")
    with open_engine(engine, cfg) as eng:
        out.version = eng.version()
        meta = {
            "engine": engine,
            "engine_version": out.version,
            "dtype": dtype,
            "tp": tp,
            "model": spec.name,
            "device": device_name(cfg.device),
        }
        t0 = time.perf_counter()
        for _ in range(reruns):
            out.runs.append(mixed_batch(eng, prompts, choices, top_k, meta))
        out.wall_s = time.perf_counter() - t0
    for lanes in out.runs:
        for run in lanes.values():
            run.meta["wall_s_all_adapters"] = round(out.wall_s / reruns, 3)
    return out


def engine_options(engine: str) -> dict:
    """Options that point an engine at its own installation: ``LPDIFF_<ENGINE>_PYTHON`` (another interpreter) and
    ``LPDIFF_<ENGINE>_PYTHONPATH`` (an unpacked offline bundle, put on the lane's PYTHONPATH, which implies a
    subprocess lane running this interpreter); ``LPDIFF_<ENGINE>_OPTIONS``, a JSON object of engine options, is
    merged over them (a suite run with a workaround, e.g. '{"env": {"CUDA_LAUNCH_BLOCKING": "1"}}' for vllm)."""
    name = f"LPDIFF_{engine.upper()}"
    python = os.environ.get(f"{name}_PYTHON")
    path = os.environ.get(f"{name}_PYTHONPATH")
    opts: dict = {}
    if python or path:
        opts["python"], opts["lane"] = python or sys.executable, "subprocess"
    if path:
        opts["lane_env"] = {"PYTHONPATH": path}
    if extra := os.environ.get(f"{name}_OPTIONS"):
        try:
            given = json.loads(extra)
        except json.JSONDecodeError as e:
            raise InputError(f"{name}_OPTIONS must be a JSON object of engine options, got {extra!r}: {e}") from None
        if not isinstance(given, dict):
            raise InputError(f"{name}_OPTIONS must be a JSON object of engine options, got {extra!r}")
        opts.update(given)
    return opts


# Engines a job names (comma-separated): a missing one FAILs the job instead of skipping (nightly lanes, CI jobs)
REQUIRE_ENV = "LPDIFF_REQUIRE_ENGINES"


def engine_missing(engine: str) -> str | None:
    """Why ``engine`` cannot run here (None when it can), naming the command that installs it
    (``Capabilities.install``): one on lpdiff's own dependencies always can; another needs its module importable,
    or, where it runs from an offline bundle, an installation named by ``engine_options``."""
    from lpdiff.engines import ENGINES, capabilities

    if engine not in ENGINES:
        return f"unknown engine {engine!r}; known engines: {', '.join(ENGINES)}"
    c = capabilities(engine)
    if not c.module or (c.offline_python and "python" in engine_options(engine)) or importlib.util.find_spec(c.module):
        return None
    bundle = f" (or set LPDIFF_{engine.upper()}_PYTHONPATH to an unpacked offline bundle)" if c.offline_python else ""
    return f"engine {engine!r} is not installed here: {c.install}{bundle}"


def engine_required(engine: str) -> bool:
    """Whether this job named ``engine`` (``$LPDIFF_REQUIRE_ENGINES``, comma-separated; ``all`` = every engine):
    then a missing engine is a failure, not a skip."""
    named = {e.strip() for e in os.environ.get(REQUIRE_ENV, "").split(",") if e.strip()}
    return engine in named or "all" in named
