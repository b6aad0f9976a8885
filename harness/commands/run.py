"""``lpdiff run`` / ``lpdiff regen``: one model, its adapters and a prompt set, run on the engine under test and
judged against stored reference runs. The CLI and the pytest suites both go through here, so a verdict means the
same thing wherever it is printed.

Route: the CLI's arguments as one ``RunRequest`` -> ``plan()`` resolves it once (models the engine serves, each
model's spec, adapters and prompts, the TP sizes, the engine options) into a ``Plan`` of ``Job``s -> per job: the
doctor's preflight, reference runs through the store (``stored``; ``regen`` recomputes them), one engine session
over the mixed batch, metrics against the references, verdicts against the recorded thresholds -> ``RunReport``.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from lpdiff.engines import DEFAULT_ENGINE, REFERENCE_ENGINE
from lpdiff.harness.commands.bisect import ARCHS as BISECT_ARCHS
from lpdiff.harness.commands.preflight import preflight
from lpdiff.harness.pipeline.metrics import compare, lane_fidelity, near_tie_eps, position_detail
from lpdiff.harness.pipeline.references import References, default_store
from lpdiff.harness.pipeline.session import Lanes, run_session
from lpdiff.harness.pipeline.store import BaselineStore
from lpdiff.harness.pipeline.thresholds import lookup
from lpdiff.harness.pipeline.verdict import LaneId, Verdict, judge, next_step
from lpdiff.harness.spec.adapters import adapter_groups
from lpdiff.harness.spec.errors import InputError, UsageError
from lpdiff.harness.spec.prompt_sources import PromptSource
from lpdiff.harness.spec.resolve import Resolved, resolve, resolve_model

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class Job:
    """What one ``lpdiff run`` lane computes; validated once here."""

    model: str  # catalog name, checkpoint directory or Hub id ORG/NAME[@REV]
    engine: str = REFERENCE_ENGINE  # engine under test
    reference: str = REFERENCE_ENGINE  # engine whose stored runs are the reference
    dtype: str = "float32"
    ref_dtype: str = "float32"
    tp: int = 1
    adapters: tuple[str, ...] | None = None  # zoo names, PEFT dirs or Hub ids; None = all of a zoo model's
    prompt_set: str = "default"
    prompts: PromptSource | None = None  # user prompts (JSONL or Hub dataset) instead of prompt_set
    top_k: int = 8
    num_layers: int | None = None
    options: dict = field(default_factory=dict)  # engine options for the engine under test
    baselines: str | None = None  # the store given as --baselines (None: $LPDIFF_BASELINES or the shipped one)
    # the model, adapters and prompts as plan() resolved them (shared by the model's jobs at each TP size);
    # None for a Job built by hand: resolve_job resolves it then
    resolved: Resolved | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.tp < 1 or self.top_k < 0:
            raise InputError(f"--tp must be >= 1 and --top-k >= 0, got tp={self.tp}, top_k={self.top_k}")
        for flag, d in (("--dtype", self.dtype), ("--ref-dtype", self.ref_dtype)):
            if d not in DTYPES:
                raise InputError(f"{flag} must be one of {', '.join(DTYPES)}, got {d!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise InputError(f"--num-layers must be >= 1, got {self.num_layers}")

    @property
    def engine_pair(self) -> str:
        return f"{self.engine}:{self.dtype}-vs-{self.reference}:{self.ref_dtype}"

    def regen_command(self) -> str:
        """The command that regenerates exactly this job's references."""
        # --reference / --ref-dtype: what the stored runs were computed with (regen runs no engine under test)
        cmd = (
            f"lpdiff regen --model {shlex.quote(self.model)} --reference {self.reference} --ref-dtype {self.ref_dtype}"
        )
        cmd += "".join(f" --adapter {shlex.quote(a)}" for a in self.adapters or ())
        cmd += f" --prompt-set {self.prompt_set}" if self.prompt_set != "default" else ""
        cmd += self.prompts.flags() if self.prompts else ""
        cmd += f" --num-layers {self.num_layers}" if self.num_layers else ""
        cmd += f" --top-k {self.top_k}" if self.top_k != 8 else ""
        # the store this run read: regenerating into any other (the shipped baselines in a checkout) would leave
        # this run's error as it was and rewrite files nobody asked to touch
        store = self.baselines or os.environ.get("LPDIFF_BASELINES")
        cmd += f" --baselines {shlex.quote(str(store))}" if store else ""
        return cmd

    def is_self_check(self) -> bool:
        return self.engine == self.reference and self.dtype == self.ref_dtype


def what_it_judges(job: Job) -> str:
    """The line above ``lpdiff run``'s table: what the verdicts below prove."""
    if job.is_self_check():
        return (
            f"install self-check: {job.engine} ({job.dtype}) against its own stored reference runs; PASS means "
            f"this install reproduces them (no engine under test is judged)"
        )
    return f"{job.engine} ({job.dtype}) judged against the stored {job.reference} ({job.ref_dtype}) reference runs"


@dataclass(slots=True)
class JobResult:
    job: Job
    runs: Lanes  # engine-under-test runs
    refs: Lanes  # reference runs
    verdicts: list[Verdict] = field(default_factory=list)


def resolve_job(job: Job) -> Resolved:
    if job.resolved is None:
        job.resolved = resolve(job.model, job.adapters, job.prompts or job.prompt_set, job.num_layers)
    return job.resolved


def references(
    job: Job, store: BaselineStore, regen: bool = False, log: Callable[[str], None] = lambda s: None
) -> References:
    # --prompts FILE runs are no prompt set: keyed by their prompts' hash alone, so they never supersede (and prune
    # never removes) the default set's baselines
    return References(
        store,
        job.reference,
        job.ref_dtype,
        None,
        job.top_k,
        "regen" if regen else "stored",
        job.regen_command(),
        None if job.prompts else job.prompt_set,
        log,
    )


def judge_runs(job: Job, runs: Lanes, refs: Lanes) -> list[Verdict]:
    """One verdict per lane; positions at or after a router near-tie are judged apart (reported as a share).
    Delta fidelity is reported per module group where the batch has single-group adapters (lane_fidelity)."""
    threshold = lookup(job.model, job.engine_pair, job.dtype, job.tp)
    eps = near_tie_eps(job.dtype, job.ref_dtype)
    r = resolve_job(job)
    groups = {a: adapter_groups(s.path) for a, s in r.adapters.items() if a in runs}
    fidelities = lane_fidelity(runs, refs, groups)
    verdicts = []
    for a in runs:
        fidelity = None if a is None else fidelities[a]
        own, split = _own_and_groups(fidelity)
        m = compare(runs[a], refs[a], near_tie_eps=eps)
        detail = position_detail(runs[a], refs[a], eps)
        lane = LaneId(job.model, job.engine_pair, job.dtype, job.tp, a or "-")
        hint = next_step(
            job.engine_pair,
            job.model,
            lane.adapter,
            job.tp,
            job.adapters or (),
            job.options,
            bisect=r.spec.arch in BISECT_ARCHS,
        )
        verdicts.append(
            judge(
                m,
                threshold,
                delta_fidelity=own,
                exclude_near_ties=m.clean is not None,
                lane=lane,
                groups=split,
                detail=detail,
                next_step=hint,
            )
        )
    return verdicts


def _own_and_groups(fidelity):
    """A multi-group lane's own delta fidelity (judged) and its groups' values from the batch's single-group lanes
    (only named: a lane never fails for another adapter's delta)."""
    if isinstance(fidelity, dict) and "adapter" in fidelity:
        return fidelity["adapter"], {g: f for g, f in fidelity.items() if g != "adapter"}
    return fidelity, {}


def run_job(
    job: Job, store: BaselineStore | None = None, regen: bool = False, log: Callable[[str], None] | None = None
) -> JobResult:
    log = log or (lambda s: print(s, file=sys.stderr))
    store = store if store is not None else default_store()
    r = resolve_job(job)
    preflight(r, [job.engine, *([job.reference] if regen else [])], log)
    if regen:
        log(
            f"regenerating {len(r.adapters) + 1} reference run(s) for {job.model} with {job.reference} "
            f"({job.ref_dtype})"
        )
    refs = references(job, store, regen, log).runs(r.spec, r.adapters, r.prompts)
    if regen and job.engine == job.reference and job.dtype == job.ref_dtype and job.tp == 1:
        runs = refs  # nothing new to compute: the job is the reference itself
    else:
        runs = run_session(job.engine, r.spec, r.adapters, r.prompts, job.dtype, job.tp, job.top_k, job.options).first
    return JobResult(job, runs, refs, judge_runs(job, runs, refs))


def unsupported(engine: str, model: str) -> str | None:
    """Why ``engine`` cannot serve ``model`` (None when it can), from the engine's own capabilities: the model's
    config alone (no adapters, prompts or weights are resolved for a model that is then skipped)."""
    from lpdiff.engines.base import capabilities

    arch = resolve_model(model, weights=False).arch
    c = capabilities(engine)
    return (
        None if c.serves(arch) else f"the {engine} engine does not serve {arch} (it serves {', '.join(c.archs or ())})"
    )


# The TP sizes a default run covers: TP 1, and TP 2 as the smallest sharded layout (every row- and column-parallel
# split, the all-reduces, rank 0's logprobs): each larger size runs the same code with more ranks.
DEFAULT_TP = (1, 2)


def default_tps(engine: str) -> tuple[int, ...]:
    """The TP sizes ``lpdiff run`` and the CPU suite cover when none is asked for: those of DEFAULT_TP that the engine
    declares (``Capabilities.tp``) and this machine can place, one GPU per rank where there are GPUs, else the sizes
    the engine runs without one (``Capabilities.cpu_tp``: triton's gloo ranks). hf -> (1,); triton -> (1, 2)."""
    import torch

    from lpdiff.engines.base import capabilities

    c = capabilities(engine)
    gpus = torch.cuda.device_count()
    here = [t for t in c.tp if t <= gpus] if gpus else list(c.cpu_tp)
    return tuple(t for t in DEFAULT_TP if t in here) or (1,)


def zoo_models(engine: str, asked: Sequence[str] = ()) -> tuple[list[str], list[tuple[str, str]]]:
    """The models a run covers and those skipped with the reason: ``asked`` as given (a model the engine cannot
    serve is skipped, not fatal), or by default every tiny MoE zoo model."""
    from lpdiff.harness.spec.catalog import list_models

    names = list(asked) or [
        m.name for m in list_models() if m.path is not None and m.name.startswith("tiny-") and m.arch != "qwen3"
    ]
    chosen, skipped = [], []
    for name in names:
        why = unsupported(engine, name)
        (skipped.append((name, why)) if why else chosen.append(name))
    return chosen, skipped


@dataclass(frozen=True, slots=True)
class RunRequest:
    """``lpdiff run`` / ``lpdiff regen``'s arguments as the CLI parsed them; ``plan()`` resolves them once."""

    regen: bool = False  # compute the reference runs into the store instead of judging an engine
    models: tuple[str, ...] = ()  # () = every tiny MoE zoo model the engine serves
    engine: str | None = None  # None: DEFAULT_ENGINE for run, the reference for regen
    dtype: str = "float32"
    reference: str = REFERENCE_ENGINE
    ref_dtype: str = "float32"
    tps: tuple[int, ...] = ()  # () = default_tps(engine) for run, TP 1 for regen (references never shard)
    adapters: tuple[str, ...] = ()  # () = a zoo model's all
    prompt_set: str = "default"
    prompts: PromptSource | None = None
    top_k: int = 8
    num_layers: int | None = None
    options: dict = field(default_factory=dict)
    baselines: str | None = None
    save_runs: str | None = None  # folder for the engine-under-test runs (.npz)


@dataclass(slots=True)
class Plan:
    """A request resolved: the engine, the jobs (model x TP size, each carrying its model's one resolution) and
    the models skipped with the reason. Every stage of ``run`` reads its inputs from here."""

    request: RunRequest
    engine: str
    jobs: list[Job]
    skipped: list[tuple[str, str]]


@dataclass(slots=True)
class RunReport:
    """What ``run`` gives the CLI to print: the verdicts, the jobs whose engine died, the models skipped."""

    plan: Plan
    verdicts: list[Verdict] = field(default_factory=list)
    died: list[str] = field(default_factory=list)  # "model (tp=N)" of each job whose engine failed

    @property
    def failed(self) -> bool:
        return bool(self.died) or any(not v.passed for v in self.verdicts)

    def summary(self) -> str:
        failed = sum(not v.passed for v in self.verdicts)
        return (
            f"{len(self.verdicts) - failed} passed, {failed} failed"
            + (f"; engine failed on: {', '.join(self.died)}" if self.died else "")
            + (f"; skipped: {', '.join(m for m, _ in self.plan.skipped)}" if self.plan.skipped else "")
        )


def plan(request: RunRequest) -> Plan:
    """The engine and its models, each model resolved once (spec, adapters, prompts) for all its TP sizes."""
    from lpdiff.harness.pipeline.session import engine_missing

    engine = request.engine or (request.reference if request.regen else DEFAULT_ENGINE)
    if why := engine_missing(engine):
        raise UsageError(why)
    chosen, skipped = zoo_models(engine, request.models)
    tps = tuple(dict.fromkeys(request.tps or ((1,) if request.regen else default_tps(engine))))
    jobs = []
    for model in chosen:
        first = Job(
            model=model,
            engine=engine,
            reference=request.reference,
            dtype=request.dtype,
            ref_dtype=request.ref_dtype,
            tp=tps[0],
            adapters=request.adapters or None,
            prompt_set=request.prompt_set,
            prompts=request.prompts,
            top_k=request.top_k,
            num_layers=request.num_layers,
            options=dict(request.options),
            baselines=request.baselines,
        )
        resolved = resolve_job(first)
        jobs += [first] + [replace(first, tp=tp, resolved=resolved) for tp in tps[1:]]
    if not jobs:
        raise UsageError(f"engine {engine!r} serves none of the models asked for")
    return Plan(request, engine, jobs, skipped)


def run(
    request: RunRequest,
    log: Callable[[str], None] = lambda s: None,
    progress: Callable[[list[Job]], Iterable[Job]] = lambda jobs: jobs,
) -> RunReport:
    """Every job of the plan: an engine that hangs, crashes or raises (LaneDied/LaneError) is a FAIL with its log
    and the run goes on. ``progress`` wraps the job list (a tqdm bar: its ``write`` then carries the log)."""
    from lpdiff.engines import LaneDied, LaneError

    p = plan(request)
    for model, why in p.skipped:
        log(f"skipped {model}: {why}")
    report = RunReport(p)
    store = default_store(request.baselines)
    regenerated = set()  # references never shard: one regen per model serves each of its TP sizes
    bar = progress(p.jobs)
    say = (lambda s: bar.write(s, file=sys.stderr)) if hasattr(bar, "write") else log
    for job in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{job.model} tp={job.tp}")
        try:
            res = run_job(job, store, regen=request.regen and job.model not in regenerated, log=say)
            regenerated.add(job.model)
        except (LaneDied, LaneError) as e:
            report.died.append(f"{job.model} (tp={job.tp})")
            log(f"FAIL {job.model} tp={job.tp}: the {job.engine} engine failed before giving logprobs:\n{e}")
            continue
        report.verdicts += res.verdicts
        if request.save_runs:
            save_runs(res, Path(request.save_runs))
    return report


def save_runs(res: JobResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    job = res.job
    model = job.model.strip("/").replace("/", "--")  # a directory or Hub id names one file
    tp = f".tp{job.tp}" if job.tp > 1 else ""  # each TP size's runs side by side in one folder
    for a, r in res.runs.items():
        r.save(out / f"{model}.{job.engine}.{job.dtype}{tp}.{a or 'base'}.npz")
