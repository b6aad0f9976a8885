"""A job: one model, its adapters and a prompt set, run on an engine under test and judged against stored
reference runs. The CLI (``lpdiff run/regen``) and the pytest suites both go through here, so a verdict means the
same thing wherever it is printed.

Reference runs are baselines in the store, keyed by content (model weights or config+seed, adapter tensors,
prompts, dtype, TP, engine, top-k). They are computed only by ``regen`` (``lpdiff regen`` or
``pytest --lpdiff-regen``); a missing one is an error that names that command.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.harness.pipeline.provenance import PACKAGE_ROOT, device_name
from lpdiff.harness.types import AdapterSpec, LogprobRun, ModelSpec

ZOO_ADAPTERS = Path(__file__).resolve().parents[1] / "zoo_adapters"


def default_store(root: str | os.PathLike | None = None):
    from lpdiff.harness.pipeline.store import BaselineStore

    root = root or os.environ.get("LPDIFF_BASELINES") or PACKAGE_ROOT / "baselines"
    return BaselineStore(Path(root))


def zoo_adapters(model: str) -> dict[str, AdapterSpec]:
    """The committed adapters of a tiny zoo model: harness/zoo_adapters/<model>/<adapter>/ (PEFT format)."""
    root = ZOO_ADAPTERS / model
    if not root.is_dir():
        return {}
    return {p.name: AdapterSpec(p.name, str(p)) for p in sorted(root.iterdir()) if (p / "adapter_config.json").exists()}


@dataclass(slots=True)
class Job:
    model: str  # catalog name
    engine: str = "hf"  # engine under test
    reference: str = "hf"  # engine whose stored runs are the reference
    dtype: str = "float32"
    ref_dtype: str = "float32"
    tp: int = 1
    adapters: tuple[str, ...] | None = None  # zoo adapter names; None = all of the model's
    prompt_set: str = "default"
    top_k: int = 8
    num_layers: int | None = None
    options: dict = field(default_factory=dict)  # engine options for the engine under test

    def __post_init__(self):
        assert self.tp >= 1 and self.top_k >= 0

    @property
    def engine_pair(self) -> str:
        return f"{self.engine}:{self.dtype}-vs-{self.reference}:{self.ref_dtype}"


@dataclass(slots=True)
class JobResult:
    job: Job
    runs: dict[str | None, LogprobRun]  # adapter name (None = base) -> engine-under-test run
    refs: dict[str | None, LogprobRun]  # adapter name -> reference run
    verdicts: list = field(default_factory=list)


def resolve(job: Job) -> tuple[ModelSpec, dict[str, AdapterSpec], list[list[int]]]:
    from lpdiff.harness.spec.catalog import get_model
    from lpdiff.harness.spec.prompts import prompt_set

    spec = get_model(job.model, num_layers=job.num_layers)
    available = zoo_adapters(job.model)
    names = list(available) if job.adapters is None else list(job.adapters)
    missing = [n for n in names if n not in available]
    if missing:
        raise KeyError(f"model {job.model!r} has no adapter(s) {missing}; available: {sorted(available)}")
    return spec, {n: available[n] for n in names}, prompt_set(job.model, job.prompt_set)


def mixed_batch(eng, prompts: list[list[int]], choices: list[str | None], top_k: int = 0,
                meta: dict | None = None) -> dict[str | None, LogprobRun]:
    """Every prompt once per adapter choice (None = base), all in one call of an open engine (the way a serving
    engine sees a mixed batch) -> one LogprobRun per choice."""
    flat = eng.prompt_logprobs([p for _ in choices for p in prompts],
                               adapter=[c for c in choices for _ in prompts], top_k=top_k)
    n = len(prompts)
    return {c: LogprobRun(flat[i * n:(i + 1) * n], {**(meta or {}), "adapter": c}) for i, c in enumerate(choices)}


def run_engine(engine: str, spec: ModelSpec, adapters: dict[str, AdapterSpec], prompts: list[list[int]],
               dtype: str, tp: int = 1, top_k: int = 0, options: dict | None = None
               ) -> dict[str | None, LogprobRun]:
    """One engine session: the prompt set once per adapter (and once without), all in one batch."""
    import time

    cfg = EngineConfig(model=spec, adapters=adapters, dtype=dtype, tp=tp, options=dict(options or {}))
    choices: list[str | None] = [None, *adapters]
    with open_engine(engine, cfg) as eng:
        t0 = time.perf_counter()
        runs = mixed_batch(eng, prompts, choices, top_k)
        wall = time.perf_counter() - t0
        meta = {"engine": engine, "engine_version": eng.version(), "dtype": dtype, "tp": tp, "model": spec.name,
                "device": device_name(cfg.device), "wall_s_all_adapters": round(wall, 3)}
    for run in runs.values():
        run.meta.update(meta)
    return runs


def reference_runs(job: Job, spec: ModelSpec, adapters: dict[str, AdapterSpec], prompts: list[list[int]],
                   store, regen: bool = False, log: Callable[[str], None] = lambda s: None
                   ) -> dict[str | None, LogprobRun]:
    from lpdiff.harness.pipeline.store import baseline_key

    keys = {a: baseline_key(spec, adapters.get(a) if a else None, prompts, job.ref_dtype, 1, job.reference,
                            job.top_k) for a in [None, *adapters]}
    if regen:
        log(f"regenerating {len(keys)} reference run(s) for {job.model} with {job.reference} ({job.ref_dtype})")
        runs = run_engine(job.reference, spec, adapters, prompts, job.ref_dtype, 1, job.top_k)
        for a, key in keys.items():
            store.put(key, runs[a], overwrite=True)
            for old in store.find_stale(key):  # the same lane computed from older content
                store.delete(old)
        return runs
    return {a: store.get(key) for a, key in keys.items()}


def judge_job(job: Job, runs, refs) -> list:
    from lpdiff.harness.pipeline.metrics import compare, delta_fidelity
    from lpdiff.harness.pipeline.thresholds import lookup
    from lpdiff.harness.pipeline.verdict import judge

    from lpdiff.harness.spec.routing import near_tie_eps

    threshold = lookup(job.model, job.engine_pair, job.dtype, job.tp)
    eps = near_tie_eps(job.dtype, job.ref_dtype)
    verdicts = []
    for a in runs:
        fidelity = None if a is None else delta_fidelity(runs[a], runs[None], refs[a], refs[None])
        m = compare(runs[a], refs[a], near_tie_eps=eps)
        # positions at or after a router near-tie are judged apart (reported as a share, never silently)
        v = judge(m, threshold, delta_fidelity=fidelity, exclude_near_ties=m.clean is not None)
        v.model, v.engine_pair, v.dtype, v.tp, v.adapter = job.model, job.engine_pair, job.dtype, job.tp, a or "-"
        verdicts.append(v)
    return verdicts


def run_job(job: Job, store=None, regen: bool = False, log: Callable[[str], None] | None = None) -> JobResult:
    log = log or (lambda s: print(s, file=sys.stderr))
    store = store if store is not None else default_store()
    spec, adapters, prompts = resolve(job)
    refs = reference_runs(job, spec, adapters, prompts, store, regen, log)
    if job.engine == job.reference and job.dtype == job.ref_dtype and job.tp == 1 and regen:
        runs = refs  # nothing new to compute: the job is the reference itself
    else:
        runs = run_engine(job.engine, spec, adapters, prompts, job.dtype, job.tp, job.top_k, job.options)
    return JobResult(job, runs, refs, judge_job(job, runs, refs))
