"""``lpdiff``: run / regen / compare / models / adapters / calibrate / bisect / check / doctor / metamorphic.

``lpdiff run`` with no arguments judges every tiny zoo model (hf engine, fp32) against the committed baselines and
prints a verdict table; the exit code is 1 when any verdict FAILs, 2 on bad input or a missing baseline.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path


def _parse_options(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--option takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _jobs(args) -> list:
    from lpdiff.harness.spec.catalog import list_models
    from lpdiff.harness.pipeline.job import Job

    models = args.model or [m.name for m in list_models() if m.path is not None and m.name.startswith("tiny-")
                            and m.arch != "qwen3"]
    return [Job(model=m, engine=args.engine, reference=args.reference, dtype=args.dtype, ref_dtype=args.ref_dtype,
                tp=args.tp, adapters=tuple(args.adapter) if args.adapter else None, prompt_set=args.prompt_set,
                top_k=args.top_k, num_layers=args.num_layers, options=_parse_options(args.option)) for m in models]


def _progress(jobs, desc):
    from tqdm import tqdm

    return tqdm(jobs, desc=desc, unit="model", file=sys.stderr, disable=len(jobs) < 2 or not sys.stderr.isatty())


def cmd_run(args, regen: bool = False) -> int:
    from lpdiff.harness.pipeline.job import default_store, run_job
    from lpdiff.harness.pipeline.store import BaselineError
    from lpdiff.harness.pipeline.verdict import format_table, to_json

    store = default_store(args.baselines)
    verdicts = []
    jobs = _jobs(args)
    bar = _progress(jobs, "regen" if regen else "run")
    for job in bar:
        bar.set_postfix_str(job.model)
        try:
            res = run_job(job, store, regen=regen, log=lambda s: bar.write(s, file=sys.stderr))
        except BaselineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        verdicts += res.verdicts
        if args.save_runs:
            out = Path(args.save_runs)
            out.mkdir(parents=True, exist_ok=True)
            for a, run in res.runs.items():
                run.save(out / f"{job.model}.{job.engine}.{job.dtype}.{a or 'base'}.npz")
    print(format_table(verdicts))
    if args.json:
        Path(args.json).write_text(to_json(verdicts))
    if regen:
        return 0
    failed = [v for v in verdicts if not v.passed]
    print(f"{len(verdicts) - len(failed)} passed, {len(failed)} failed", file=sys.stderr)
    return 1 if failed else 0


def cmd_compare(args) -> int:
    from lpdiff.harness.pipeline.metrics import compare
    from lpdiff.harness.pipeline.thresholds import lookup
    from lpdiff.harness.types import AdapterSpec, LogprobRun
    from lpdiff.harness.pipeline.verdict import format_table, judge

    if args.runs:
        a, b = (LogprobRun.load(p) for p in args.runs)
        lane = [f"{r.meta.get('engine', '?')}:{r.meta.get('dtype', 'float32')}" for r in (a, b)]
        model, dtype = a.meta.get("model", "?"), a.meta.get("dtype", "float32")
        v = judge(compare(a, b), lookup(model, f"{lane[0]}-vs-{lane[1]}", dtype, int(a.meta.get("tp", 1))),
                  adapter=f"{a.meta.get('adapter') or '-'} vs {b.meta.get('adapter') or '-'}")
        print(format_table([v]))
        return 0 if v.passed else 1
    if not args.model:
        raise SystemExit("compare needs --model (two engines) or --runs A.npz B.npz (two stored runs)")
    from lpdiff.harness.pipeline.job import Job, judge_job, resolve, run_engine

    job = Job(model=args.model, engine=args.engine, dtype=args.dtype, reference=args.against,
              ref_dtype=args.against_dtype, tp=args.tp, adapters=(args.adapter,) if args.adapter else None,
              prompt_set=args.prompt_set, num_layers=args.num_layers)
    spec, adapters, prompts = resolve(job)
    test_adapters = dict(adapters)
    if args.test_adapter_dir:  # the engine under test gets other adapter files under the same name
        if len(adapters) != 1:
            raise SystemExit("--test-adapter-dir needs exactly one --adapter")
        name = next(iter(adapters))
        test_adapters = {name: AdapterSpec(name, args.test_adapter_dir)}
    runs = run_engine(job.engine, spec, test_adapters, prompts, job.dtype, job.tp, job.top_k)
    refs = run_engine(job.reference, spec, adapters, prompts, job.ref_dtype, 1, job.top_k)
    verdicts = judge_job(job, runs, refs)
    print(format_table(verdicts))
    return 0 if all(v.passed for v in verdicts) else 1


def cmd_calibrate(args) -> int:
    from lpdiff.harness.commands import calibrate as cal
    from lpdiff.harness.spec.adapter_zoo import MOE_MODELS

    models = args.model or MOE_MODELS
    if args.engine is None:
        cal.calibrate_zoo(models)
        return 0
    if not args.record_as:
        raise SystemExit("--engine needs --record-as PAIR@DTYPE (which threshold entry the noise sets)")
    a = cal.Lane(args.engine, args.dtype, _parse_options(args.option), args.tp)
    b = cal.Lane(args.against, args.against_dtype, _parse_options(args.against_option))
    record_as = [tuple(r.rsplit("@", 1)) for r in args.record_as]
    for m in models:
        cal.calibrate(m, a, b, record_as, args.factor, tp=args.tp, num_layers=args.num_layers)
    return 0


def cmd_models(args) -> int:
    from lpdiff.harness.spec.catalog import describe, list_models

    rows = [describe(m) for m in list_models()]
    cols = list(rows[0]) if rows else []
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
    return 0


def cmd_adapters(args) -> int:
    from lpdiff.harness.spec import adapters as ad

    if args.adapters_cmd == "gen":
        from lpdiff.harness.spec.catalog import get_model, load_hf_model
        import torch

        model = load_hf_model(get_model(args.model), torch.float32, "cpu")
        ad.generate_adapter(model, args.out, groups=args.groups.split(","), rank=args.rank, alpha=args.alpha,
                            seed=args.seed, layout=args.layout)
        print(f"wrote {args.out}")
    else:
        from lpdiff.harness.spec.catalog import get_model, hf_config

        ad.convert_adapter(args.src, args.dst, to=args.to, model_config=hf_config(get_model(args.model)))
        print(f"wrote {args.dst}")
    return 0


# Subcommands whose module owns its argument parser: `lpdiff doctor ...` is `lpdiff.harness.commands.doctor.main([...])`.
DELEGATED = {
    "bisect": "first layer + module where triton leaves HF (per-module errors vs noise)",
    "check": "a bf16 engine vs an fp32 reference on a full-width model, thresholds from noise measured in the run",
    "doctor": "pre-flight check of an adapter against each engine's known LoRA limits",
    "metamorphic": "an engine against itself on inputs that must give equal logprobs",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lpdiff", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")

    def selection(sp, engine_default="hf"):
        sp.add_argument("--model", action="append", help="catalog model name (repeatable; default: the tiny zoo)")
        sp.add_argument("--engine", default=engine_default, help="engine under test: hf, triton, vllm, sglang")
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        sp.add_argument("--reference", default="hf", help="engine of the stored reference runs")
        sp.add_argument("--ref-dtype", default="float32")
        sp.add_argument("--tp", type=int, default=1)
        sp.add_argument("--adapter", action="append", help="zoo adapter name (repeatable; default: all)")
        sp.add_argument("--prompt-set", default="default")
        sp.add_argument("--top-k", type=int, default=8, help="top-k logprobs stored and compared (KL, top-1)")
        sp.add_argument("--num-layers", type=int, default=None, help="reduce depth (config-built models)")
        sp.add_argument("--option", action="append", help="engine option KEY=VALUE (repeatable)")
        sp.add_argument("--baselines", default=None, help="baseline store dir (default: repo baselines/)")
        sp.add_argument("--json", default=None, help="also write the verdicts as JSON here")
        sp.add_argument("--save-runs", default=None, help="save the engine-under-test runs (.npz) here")

    selection(sub.add_parser("run", help="judge an engine against stored reference runs (default job)"))
    selection(sub.add_parser("regen", help="(re)compute reference runs and overwrite them in the store"))

    c = sub.add_parser("compare", help="compare two engines live, or two stored runs")
    c.add_argument("--runs", nargs=2, metavar=("A.npz", "B.npz"))
    c.add_argument("--model")
    c.add_argument("--engine", default="hf")
    c.add_argument("--dtype", default="float32")
    c.add_argument("--against", default="hf")
    c.add_argument("--against-dtype", default="float32")
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--adapter", default=None)
    c.add_argument("--test-adapter-dir", default=None,
                   help="give the engine under test these adapter files instead (e.g. a deliberately broken copy)")
    c.add_argument("--prompt-set", default="default")
    c.add_argument("--num-layers", type=int, default=None)

    sub.add_parser("models", help="the model catalog with shapes")

    a = sub.add_parser("adapters", help="generate or convert LoRA adapters")
    asub = a.add_subparsers(dest="adapters_cmd", required=True)
    g = asub.add_parser("gen")
    g.add_argument("--model", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--groups", default="attention,experts")
    g.add_argument("--rank", type=int, default=8)
    g.add_argument("--alpha", type=float, default=16)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--layout", default="peft3d", choices=["peft3d", "per_expert"])
    cv = asub.add_parser("convert")
    cv.add_argument("--model", required=True)
    cv.add_argument("src")
    cv.add_argument("dst")
    cv.add_argument("--to", required=True, choices=["peft3d", "per_expert"])

    cal = sub.add_parser("calibrate", help="measure noise floors between correct implementations -> thresholds")
    cal.add_argument("--model", action="append", help="model (repeatable; default: the tiny zoo)")
    cal.add_argument("--engine", default=None, help="with --against: calibrate one pair instead of the zoo plan")
    cal.add_argument("--dtype", default="float32")
    cal.add_argument("--option", action="append", help="engine option KEY=VALUE for --engine")
    cal.add_argument("--against", default="hf")
    cal.add_argument("--against-dtype", default="float32")
    cal.add_argument("--against-option", action="append")
    cal.add_argument("--record-as", action="append", metavar="PAIR@DTYPE",
                     help="threshold entry to write, e.g. vllm:bfloat16-vs-hf:float32@bfloat16")
    cal.add_argument("--factor", type=float, default=10.0)
    cal.add_argument("--tp", type=int, default=1)
    cal.add_argument("--num-layers", type=int, default=None)

    for name, help_ in DELEGATED.items():  # their own parsers take every argument, --help included
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["run"]
    try:
        if argv[0] in DELEGATED:
            module = importlib.import_module(f"lpdiff.harness.commands.{argv[0]}")
            return module.main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.cmd == "run":
            return cmd_run(args)
        if args.cmd == "regen":
            return cmd_run(args, regen=True)
        if args.cmd == "compare":
            return cmd_compare(args)
        if args.cmd == "models":
            return cmd_models(args)
        if args.cmd == "adapters":
            return cmd_adapters(args)
        if args.cmd == "calibrate":
            return cmd_calibrate(args)
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
