"""Detection power of the default triton-vs-HF verdicts: noise (20 clean reruns in one engine session) against the
threshold, and the threshold against the weakest bug-zoo fault. Writes benchmarks/results/detection.csv rows.

  python -m benchmarks.detection [--dtype float32 --dtype bfloat16] [--out CSV]
  python -m benchmarks.detection --full-width qwen3-30b-a3b [--layers 4] [--reruns 20] (GPU;
      lpdiff check's method: the reference is HF+PEFT fp32 on the full-width model, the threshold FACTOR x the noise
      measured in the same run; rows are appended)
  python -m benchmarks.detection --full-width MODEL --engine vllm|sglang|hf|triton --dtype bfloat16
      [--init-recipe peaked/v1] [--reruns 20] [--engine-step] (GPU; the engine's effect is the broken adapter's, see
      measure_engine; the engine runs at the GPU grid's prefill step, suites/test_engines_gpu.py step_options:
      at most $LPDIFF_GRID_MAX_STEP tokens, default 4096, unless --engine-step keeps the engine's own)

effect of a fault = the largest k2 over its job's verdicts (a fault is caught when any verdict fails);
min_zoo_effect_k2 = the smallest such effect over the faults; noise_* = 99.9th percentile over all
(rerun, adapter) verdicts of the clean runtime."""

from __future__ import annotations

import argparse
import atexit
import csv
import datetime
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.engines.progress import progress_log
from lpdiff.harness.commands.run import Job, judge_runs, resolve_job, run_job
from lpdiff.harness.pipeline.provenance import device_name, git_commit
from lpdiff.harness.pipeline.references import default_store
from lpdiff.harness.pipeline.session import mixed_batch
from lpdiff.kernels.faults import runtime_faults

MODELS = {"tiny-qwen3-moe": "qwen3_moe", "tiny-gpt-oss": "gpt_oss"}
COLUMNS = [
    "date",
    "commit",
    "gpu",
    "model",
    "engine_pair",
    "dtype",
    "tp",
    "noise_k2",
    "noise_max",
    "threshold_k2",
    "threshold_max",
    "min_zoo_effect_k2",
    "effect_over_threshold",
    "threshold_over_noise",
    "reruns",
    "init_recipe",
    "noise_source",
    "effect_source",
    "misses",
]
TARGET = 10.0  # both ratios this far apart: a defect clears the threshold as the threshold clears the noise


def misses(effect_over_threshold: float, threshold_over_noise: float) -> str:
    """Which side of the two ratios falls short of TARGET, and by how much ("" when neither does)."""
    out = [
        f"{name} {v:.3g} < {TARGET:g} (x{TARGET / v:.2g} short)"
        for name, v in (("effect/threshold", effect_over_threshold), ("threshold/noise", threshold_over_noise))
        if v < TARGET
    ]
    return "; ".join(out)


P999 = "p99.9 over (rerun, lane expected to PASS) of the engine vs the fp32 reference of engine_pair"


def measure(model: str, dtype: str, reruns: int = 20) -> dict:
    job = Job(model=model, engine="triton", dtype=dtype)
    first = run_job(job, log=lambda s: None)
    spec, adapters, prompts = resolve_job(job)
    k2s, maxs = [], []
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters, dtype=dtype)) as eng:
        for _ in range(reruns):
            runs = mixed_batch(eng, prompts, [None, *adapters], job.top_k)
            for v in judge_runs(job, runs, first.refs):
                k2s.append(v.metrics.k2)
                maxs.append(v.metrics.max_abs)
    thr = first.verdicts[0].threshold
    effects = {}
    for f in runtime_faults(MODELS[model]):
        res = run_job(Job(model=model, engine="triton", dtype=dtype, options={"fault": f}), log=lambda s: None)
        effects[f] = (
            max(v.metrics.k2 for v in res.verdicts),
            max(v.metrics.max_abs for v in res.verdicts),
            all(v.passed for v in res.verdicts),
        )
    nk2, nmax = float(np.percentile(k2s, 99.9)), float(np.percentile(maxs, 99.9))
    weakest = min(effects, key=lambda f: effects[f][0])
    row = detection_row(
        model, job.engine_pair, dtype, thr, nk2, nmax, effects[weakest][0], reruns, "", "weakest runtime bug-zoo fault"
    )
    print(
        f"{model} {dtype}: noise k2 {nk2:.3g} max {nmax:.3g} (p99.9 of {len(k2s)}); threshold k2 {thr.k2:.3g} "
        f"max {thr.max_abs:.3g} ({thr.provenance}); weakest fault {weakest}; per fault (k2, max, passed): "
        + "; ".join(f"{f} {e[0]:.3g} {e[1]:.3g} {'PASSED' if e[2] else 'caught'}" for f, e in effects.items()),
        file=sys.stderr,
    )
    return row


def measure_full_width(model: str, dtype: str, layers: int = 4, reruns: int = 20) -> dict:
    """The same row for a full-width catalog model, through harness.check (GPU): noise = the clean runtime's
    ``reruns`` runs against HF+PEFT fp32 over every correct adapter lane and the base."""
    import tempfile

    from lpdiff.harness.commands import check
    from lpdiff.harness.spec.catalog import get_model

    arch = get_model(model).arch
    faults = runtime_faults(arch)
    store = default_store()
    with tempfile.TemporaryDirectory() as tmp:
        case = check.build_case(model, layers, tmp, layouts=("peft3d",))
        clean, results = check.fault_sweep(case, faults, dtype, k=reruns, store=store, log=lambda s: None)
        ref = check.reference_runs(case, "hf", "float32", None, store, log=lambda s: None)
    nk2, nmax, n = check_noise_p999(clean, ref)
    effects = {
        f: max(v.metrics.k2 for v in r.verdicts if v.expected == "PASS") for f, r in results.items() if r is not None
    }
    thr = clean.threshold
    weakest = min(effects, key=effects.get)
    print(
        f"{model} x{layers} {dtype}: noise k2 {nk2:.3g} max {nmax:.3g} (p99.9 of {n}); threshold k2 "
        f"{thr.k2:.3g} max {thr.max_abs:.3g} ({thr.note}); clean {'as expected' if clean.as_expected else 'NOT'}; "
        f"per fault k2 (caught?): "
        + "; ".join(
            f"{f} " + ("not reached" if r is None else f"{effects[f]:.3g} {'MISSED' if check.missed(r) else 'caught'}")
            for f, r in results.items()
        ),
        file=sys.stderr,
    )
    return detection_row(
        f"{model} x{layers}",
        thr.engine_pair,
        dtype,
        thr,
        nk2,
        nmax,
        effects[weakest],
        reruns,
        case.spec.init_recipe,
        "weakest runtime bug-zoo fault",
    )


def measure_engine(
    model: str,
    engine: str,
    dtype: str,
    layers: int = 4,
    reruns: int = 20,
    init_recipe: str | None = None,
    device: str = "cuda",
    lengths=None,
    layouts: Sequence[str] | None = None,
    reference: str = "hf",
    routing_replay: bool = False,
    options: dict | None = None,
) -> dict:
    """A serving engine's row (vLLM and SGLang have no fault switches): ``reruns`` runs of lpdiff check's mixed
    batch; noise = p99.9 over (run, correct lane) of k2 against HF+PEFT fp32, effect = the broken adapter's k2
    (every expert's LoRA-B shifted one expert; the smallest over the layouts served), threshold = the check's.
    ``layouts``: the adapter files served (default: every layout the engine reads); ``reference``: the fp32 engine
    judged against (triton for hf's own fp32 row, which against itself would be a self-comparison). The verdicts are
    printed, and appended to $LPDIFF_CHECK_CSV_DIR/engines_gpu.csv when that is set, as the GPU suite does.
    ``routing_replay``: lpdiff check --routing-replay (harness/commands/replay.py); the noise is then each run
    against the HF+PEFT fp32 reference replaying that run's own expert ids. ``options``: the engine's, merged over
    its defaults (main passes the GPU grid's prefill step); the row's noise_source names the step they set."""
    from lpdiff.harness.commands import check

    store = default_store()
    log = progress_log(f"[{model}-{engine}-{dtype}] ")
    case = _case(model, layers, init_recipe, device, tuple(lengths or ()), log)
    req = check.CheckRequest(
        case, engine, k=reruns, dtype=dtype, layouts=layouts, reference=reference, options=dict(options or {}) or None
    )
    if routing_replay:
        from lpdiff.harness.commands.replay import replay_check, replayed_references

        res = replay_check(req, log=log)
        refs = replayed_references(case, res.runs) if res.error is None else []
    else:
        res = check.run_check(req, store=store, log=log)
        ref = check.reference_runs(case, reference, "float32", None, store, log=log)
    print(check.format_result(res), file=sys.stderr)
    if os.environ.get("LPDIFF_CHECK_CSV_DIR"):
        check.write_csv(res, Path(os.environ["LPDIFF_CHECK_CSV_DIR"]) / "engines_gpu.csv")
    if res.error is not None:
        raise RuntimeError(f"{engine} on {model}: {res.error}")
    nk2, nmax, n = replay_noise_p999(res, refs) if routing_replay else check_noise_p999(res, ref)
    effect = min(v.metrics.k2 for v in res.verdicts if v.expected == "FAIL")
    thr = res.threshold
    print(
        f"{engine} {model} x{layers} {dtype} ({case.spec.init_recipe}): noise k2 {nk2:.3g} (p99.9 of {n}), "
        f"threshold {thr.k2:.3g}, broken {effect:.3g}; {'as expected' if res.as_expected else 'NOT as expected'}",
        file=sys.stderr,
    )
    row = detection_row(
        f"{model} x{layers}",
        thr.engine_pair,
        dtype,
        thr,
        nk2,
        nmax,
        effect,
        reruns,
        case.spec.init_recipe,
        "the broken adapter, smallest over layouts",
    )
    if options:
        from lpdiff.engines import capabilities

        step = capabilities(engine).prefill_step_for(case.spec.arch, options)
        row["noise_source"] += f"; {engine} at {step}-token prefill steps"
    return row


def grid_step_options(engine: str, model: str) -> dict:
    """The GPU grid's engine options for ``model`` (its prefill step where that is below the engine's own, with
    $LPDIFF_<ENGINE>_OPTIONS): engine rows are measured at the settings the grid's verdicts ran with."""
    from suites.test_engines_gpu import step_options

    return step_options(engine, model)


_CASES: dict[tuple, object] = {}


def _case(model: str, layers: int, init_recipe: str | None, device: str, lengths: tuple, log):
    """One check case per (model, depth, recipe) in this process, its files in a temp dir kept until exit: the rows
    of one model (each dtype, each engine) share its adapters instead of building them again."""
    import tempfile

    from lpdiff.harness.commands import check

    key = (model, layers, init_recipe, device, lengths)
    if key not in _CASES:
        tmp = tempfile.mkdtemp(prefix="lpdiff-detection-")
        atexit.register(shutil.rmtree, tmp, True)
        kw = {"lengths": lengths} if lengths else {}
        _CASES[key] = check.build_case(model, layers, tmp, device=device, init_recipe=init_recipe, log=log, **kw)
    return _CASES[key]


def check_noise_p999(res, ref) -> tuple[float, float, int]:
    """p99.9 of k2 and max |Δ| over (run, lane expected to PASS) of a check's runs against the fp32 reference
    runs ``ref`` -> (k2, max, how many)."""
    from lpdiff.harness.pipeline.metrics import compare

    correct = [v.adapter for v in res.verdicts if v.expected == "PASS"]
    ms = [
        compare(run[None if lane == "base" else lane], ref[None if lane == "base" else lane.split(".")[0]])
        for run in res.runs
        for lane in correct
    ]
    return (
        float(np.percentile([m.k2 for m in ms], 99.9)),
        float(np.percentile([m.max_abs for m in ms], 99.9)),
        len(ms),
    )


def replay_noise_p999(res, refs) -> tuple[float, float, int]:
    """check_noise_p999 with routing replay: run j of each lane expected to PASS against refs[j], the fp32
    reference replaying run j's own expert ids for that lane."""
    from lpdiff.harness.pipeline.metrics import compare

    correct = [None if v.adapter == "base" else v.adapter for v in res.verdicts if v.expected == "PASS"]
    ms = [compare(run[lane], refs[j][lane]) for j, run in enumerate(res.runs) for lane in correct]
    return (
        float(np.percentile([m.k2 for m in ms], 99.9)),
        float(np.percentile([m.max_abs for m in ms], 99.9)),
        len(ms),
    )


def detection_row(
    model: str,
    engine_pair: str,
    dtype: str,
    thr,
    nk2: float,
    nmax: float,
    effect: float,
    reruns: int,
    init_recipe: str,
    effect_source: str,
) -> dict:
    """One detection.csv row (without ``misses``); ``thr``: the threshold's k2 and max_abs."""
    return dict(
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        gpu=device_name(),
        model=model,
        engine_pair=engine_pair,
        dtype=dtype,
        tp=1,
        noise_k2=f"{nk2:.3g}",
        noise_max=f"{nmax:.3g}",
        threshold_k2=f"{thr.k2:.3g}",
        threshold_max=f"{thr.max_abs:.3g}",
        min_zoo_effect_k2=f"{effect:.3g}",
        effect_over_threshold=f"{effect / thr.k2:.3g}",
        threshold_over_noise=f"{thr.k2 / max(nk2, 1e-300):.3g}",
        reruns=reruns,
        init_recipe=init_recipe,
        noise_source=P999,
        effect_source=effect_source,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", action="append")
    p.add_argument("--model", action="append")
    p.add_argument("--full-width", action="append", metavar="MODEL", help="catalog model at full width (GPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reruns", type=int, default=20)
    p.add_argument("--engine", default=None, help="with --full-width: judge this engine (vllm, sglang, hf, triton)")
    p.add_argument("--init-recipe", default=None, help="with --engine: the full-size model's init recipe")
    p.add_argument("--layout", action="append", help="with --engine: serve only this adapter layout (repeatable)")
    p.add_argument("--reference", default="hf", choices=["hf", "triton"], help="with --engine: the fp32 reference")
    p.add_argument(
        "--routing-replay",
        action="store_true",
        help="with --engine: judge against the fp32 reference "
        "replaying the engine's expert ids (lpdiff check --routing-replay)",
    )
    p.add_argument(
        "--engine-step",
        action="store_true",
        help="with --engine: run at the engine's own prefill step instead of the GPU grid's",
    )
    p.add_argument("--commit", help="the commit to record (GPU machines have no git)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "detection.csv"))
    args = p.parse_args(argv)
    if args.commit:
        os.environ["LPDIFF_COMMIT"] = args.commit
    dtypes = args.dtype or ["float32"]
    if args.full_width and args.engine:
        jobs = [
            lambda m=m, d=d: measure_engine(
                m,
                args.engine,
                d,
                args.layers,
                args.reruns,
                args.init_recipe,
                layouts=args.layout,
                reference=args.reference,
                routing_replay=args.routing_replay,
                options=None if args.engine_step else grid_step_options(args.engine, m),
            )
            for m in args.full_width
            for d in dtypes
        ]
    elif args.full_width:
        jobs = [
            lambda m=m, d=d: measure_full_width(m, d, args.layers, args.reruns) for m in args.full_width for d in dtypes
        ]
    else:
        jobs = [lambda m=m, d=d: measure(m, d) for m in (args.model or list(MODELS)) for d in dtypes]
    for job in jobs:  # rows are appended as measured: a GPU call cut short keeps the rows it finished
        r = job()
        r["misses"] = misses(float(r["effect_over_threshold"]), float(r["threshold_over_noise"]))
        new = not Path(args.out).exists()
        with open(args.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                w.writeheader()
            w.writerow(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
