"""``lpdiff``: one click command tree over the commands in harness/commands/.

Exit codes (README "Exit codes"): 0 every verdict as expected; 1 a verdict failed (or was not as expected);
2 bad input, a missing/stale/corrupt baseline or an engine that is not installed — one line naming the fix;
3 lpdiff itself crashed (a bug: the traceback is printed). ``lpdiff`` alone runs ``lpdiff run``.
"""

from __future__ import annotations

import json
import signal
import sys
import traceback
from pathlib import Path

import click

import lpdiff
from lpdiff.engines import ENGINES  # the registry alone: numpy and torch load with an engine
from lpdiff.harness.cli_store import baselines, report

# The error classes only, from a module that imports nothing: `lpdiff --help` and `--version` start in well under a
# second (importing torch costs seconds); tests/test_cli.py checks that nothing heavier is imported.
from lpdiff.harness.spec.errors import InputError, UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CRASH = 0, 1, 2, 3
DTYPES = click.Choice(["float32", "bfloat16", "float16"])
# spec.adapters.LAYOUTS, spelt out so that the CLI starts without importing torch (tests/test_cli.py compares them)
LAYOUTS = click.Choice(["peft3d", "per_expert", "per_expert_gate"])


def parse_options(items) -> dict:
    """``--option KEY=VALUE`` (repeatable): VALUE is JSON when it parses as JSON, else a string."""
    out = {}
    for item in items or ():
        if "=" not in item:
            raise click.BadParameter(f"takes KEY=VALUE, got {item!r}", param_hint="--option")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _progress(items, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="model", file=sys.stderr, disable=len(items) < 2 or not sys.stderr.isatty())


def _need_engine(engine: str) -> None:
    from lpdiff.harness.pipeline.session import engine_missing

    if why := engine_missing(engine):
        raise UsageError(why)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(lpdiff.__version__, "--version", prog_name="lpdiff")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Logprob-diff regression harness for LoRA adapters on Mixture-of-Experts LLMs."""
    if ctx.invoked_subcommand is None:
        ctx.exit(ctx.invoke(run))


def selection(f):
    """The options that pick what ``run`` and ``regen`` compute."""
    opts = [
        click.option(
            "--model",
            "models",
            multiple=True,
            help="catalog model, checkpoint directory or Hub id "
            "ORG/NAME[@REV] (repeatable; default: every tiny zoo model the engine serves)",
        ),
        click.option(
            "--engine",
            default=None,
            help="engine under test: triton (run's default: lpdiff's own engine), "
            "vllm, sglang, or hf (the install self-check: HF+PEFT against its own stored runs; regen's "
            "default)",
        ),
        click.option("--dtype", type=DTYPES, default="float32", show_default=True),
        click.option("--reference", default="hf", show_default=True, help="engine of the stored reference runs"),
        click.option("--ref-dtype", type=DTYPES, default="float32", show_default=True),
        click.option(
            "--tp",
            "tps",
            type=click.IntRange(min=1),
            multiple=True,
            help="tensor-parallel size "
            "(repeatable; default: TP 1 and 2 where the engine runs them here, commands/run.py default_tps)",
        ),
        click.option(
            "--adapter",
            "adapters",
            multiple=True,
            help="zoo adapter name, PEFT directory or Hub repo "
            "[hf://datasets/]ORG/NAME[@REV][/SUBDIR] (repeatable; default: a zoo model's all)",
        ),
        click.option("--prompt-set", default="default", show_default=True),
        click.option(
            "--prompts",
            default=None,
            help="prompts FILE.jsonl (token_ids | text | messages per line) or "
            "hf://datasets/ORG/NAME[@REV], instead of --prompt-set",
        ),
        click.option("--prompts-split", default="train", show_default=True, help="dataset split for --prompts"),
        click.option(
            "--prompts-column",
            default=None,
            help="dataset column for --prompts (default: first of token_ids, input_ids, messages, text, prompt)",
        ),
        click.option("--prompts-count", type=click.IntRange(min=1), default=None, help="use only N prompts"),
        click.option("--prompts-seed", type=int, default=None, help="shuffle the dataset with this seed first"),
        click.option(
            "--top-k",
            type=click.IntRange(min=0),
            default=8,
            show_default=True,
            help="top-k logprobs stored and compared (KL, top-1)",
        ),
        click.option("--num-layers", type=click.IntRange(min=1), default=None, help="keep the first N layers"),
        click.option("--option", "options", multiple=True, help="engine option KEY=VALUE (repeatable)"),
        click.option("--baselines", default=None, help="baseline store (default: $LPDIFF_BASELINES or lpdiff's)"),
        click.option("--json", "json_path", default=None, help="also write the verdicts as JSON here"),
        click.option("--save-runs", default=None, help="save the engine-under-test runs (.npz) here"),
        click.option(
            "--wide",
            is_flag=True,
            help="every verdict column in the table's rows (default: ~120 columns "
            "wide, shared columns above, reasons below; --json has everything)",
        ),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _prompt_source(prompts, split, column, count, seed):
    from lpdiff.harness.spec.prompt_sources import PromptSource

    if prompts is None:
        if column or count or seed is not None or split != "train":
            raise click.UsageError("--prompts-split/-column/-count/-seed need --prompts")
        return None
    return PromptSource(prompts, split, column, count, seed)


def _run_or_regen(
    regen: bool,
    models,
    engine,
    dtype,
    reference,
    ref_dtype,
    tps,
    adapters,
    prompt_set,
    prompts,
    prompts_split,
    prompts_column,
    prompts_count,
    prompts_seed,
    top_k,
    num_layers,
    options,
    baselines,
    json_path,
    save_runs,
    wide=False,
) -> int:
    from lpdiff.harness.commands.run import RunRequest, run, what_it_judges
    from lpdiff.harness.pipeline.report import verdict_table
    from lpdiff.harness.pipeline.verdict import to_json

    request = RunRequest(
        regen,
        tuple(models),
        engine,
        dtype,
        reference,
        ref_dtype,
        tuple(tps),
        tuple(adapters),
        prompt_set,
        _prompt_source(prompts, prompts_split, prompts_column, prompts_count, prompts_seed),
        top_k,
        num_layers,
        parse_options(options),
        baselines,
        save_runs,
    )
    rep = run(request, log=_log, progress=lambda jobs: _progress(jobs, "regen" if regen else "run"))
    if not regen:
        click.echo(what_it_judges(rep.plan.jobs[0]))
    click.echo(verdict_table(rep.verdicts, wide=wide))
    if json_path:
        Path(json_path).write_text(to_json(rep.verdicts))
    if regen:
        return EXIT_OK
    _log(rep.summary())
    return EXIT_FAILED if rep.failed else EXIT_OK


def _run_decode(
    n,
    sampling,
    seed,
    models,
    engine,
    dtype,
    reference,
    ref_dtype,
    tps,
    adapters,
    prompt_set,
    prompts,
    prompts_split,
    prompts_column,
    prompts_count,
    prompts_seed,
    num_layers,
    options,
    **_,
) -> int:
    from lpdiff.harness.commands.decode import decode_jobs

    source = _prompt_source(prompts, prompts_split, prompts_column, prompts_count, prompts_seed) or prompt_set
    ok = decode_jobs(
        engine or "triton",
        models,
        tps,
        dtype,
        tuple(adapters) or None,
        source,
        num_layers,
        parse_options(options),
        reference,
        ref_dtype,
        n,
        sampling,
        seed,
        _need_engine,
        click.echo,
        _log,
    )
    return EXIT_OK if ok else EXIT_FAILED


@cli.command()
@selection
@click.option(
    "--case",
    default=None,
    help="judge against a trainer test case: DIR or hf://datasets/ORG/NAME[@REV] "
    "(adapter + compare_sample_train_data.pt or reference.jsonl/.parquet; docs/cases.md)",
)
@click.option(
    "--decode",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="decode verdict: the engine generates N tokens per prompt with its own logprobs, the reference "
    "scores prompt + generated by prefill (commands/decode.py)",
)
@click.option(
    "--sampling",
    type=click.Choice(["greedy", "seeded"]),
    default="greedy",
    show_default=True,
    help="with --decode: argmax, or a seeded draw from the raw distribution",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="with --decode --sampling seeded: prompt i uses seed + i",
)
def run(case=None, decode=None, sampling="greedy", seed=0, **kw) -> int:
    """Judge an engine against stored reference runs (the default command; default engine: triton, lpdiff's own,
    against the stored HF+PEFT runs; --engine hf is the install self-check)."""
    if decode is not None:
        if case:
            raise UsageError("--decode judges generated tokens against a prefill reference; --case has its own")
        return _run_decode(decode, sampling, seed, **kw)
    if case:
        from lpdiff.harness.commands.case import run_case

        kw["engine"] = kw["engine"] or "triton"
        _need_engine(kw["engine"])
        models, tps = kw["models"], kw["tps"]
        if len(models) > 1 or len(tps) > 1:
            raise UsageError("--case takes one --model (the case's base model) and at most one --tp")
        return run_case(
            case,
            models[0] if models else None,
            kw["engine"],
            kw["dtype"],
            tps[0] if tps else 1,
            kw["num_layers"],
            parse_options(kw["options"]),
            kw["json_path"],
            click.echo,
        )
    return _run_or_regen(False, **kw)


@cli.command()
@selection
def regen(**kw) -> int:
    """(Re)compute reference runs and write them to the store (nothing else is touched)."""
    return _run_or_regen(True, **kw)


@cli.command()
@click.option(
    "--runs",
    nargs=2,
    type=click.Path(),
    default=None,
    metavar="A.npz B.npz",
    help="compare two stored runs instead of two live engines",
)
@click.option("--model", default=None)
@click.option("--engine", default="hf", show_default=True)
@click.option("--dtype", type=DTYPES, default="float32", show_default=True)
@click.option("--against", default="hf", show_default=True)
@click.option("--against-dtype", type=DTYPES, default="float32", show_default=True)
@click.option("--tp", type=click.IntRange(min=1), default=1)
@click.option("--adapter", default=None, help="zoo adapter name, PEFT directory or Hub repo id")
@click.option(
    "--test-adapter-dir",
    default=None,
    help="give the engine under test these adapter files instead (e.g. a deliberately broken copy)",
)
@click.option("--prompt-set", default="default")
@click.option("--num-layers", type=click.IntRange(min=1), default=None)
@click.option("--allow-different", is_flag=True, help="with --runs: compare runs of different models or adapters")
def compare(
    runs,
    model,
    engine,
    dtype,
    against,
    against_dtype,
    tp,
    adapter,
    test_adapter_dir,
    prompt_set,
    num_layers,
    allow_different,
) -> int:
    """Compare two engines live, or two stored runs."""
    from lpdiff.harness.commands.compare import compare_live, compare_runs
    from lpdiff.harness.pipeline.report import verdict_table

    if runs:
        verdicts = [compare_runs(*runs, allow_different=allow_different)]
    elif model:
        for e in (engine, against):
            _need_engine(e)
        verdicts = compare_live(
            model, engine, dtype, against, against_dtype, tp, adapter, test_adapter_dir, prompt_set, num_layers
        )
    else:
        raise click.UsageError("compare needs --model (two engines live) or --runs A.npz B.npz (two stored runs)")
    click.echo(verdict_table(verdicts))
    return EXIT_OK if all(v.passed for v in verdicts) else EXIT_FAILED


@cli.command()
def models() -> int:
    """The model catalog with shapes."""
    from lpdiff.harness.pipeline.report import table
    from lpdiff.harness.spec.catalog import describe, list_models

    rows = [describe(m) for m in list_models()]
    cols = list(rows[0]) if rows else []
    click.echo(table([[r.get(c, "") for c in cols] for r in rows], cols))
    return EXIT_OK


@cli.group()
def adapters() -> None:
    """Generate or convert LoRA adapters."""


@adapters.command("gen")
@click.option("--model", required=True, help="catalog model, checkpoint directory or Hub id ORG/NAME[@REV]")
@click.option("--out", required=True)
@click.option("--groups", default="attention,experts", show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--alpha", type=float, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--layout", type=LAYOUTS, default="peft3d", show_default=True)
@click.option("--rslora", is_flag=True, help="rsLoRA: scaling alpha/sqrt(r) (PEFT's use_rslora)")
@click.option(
    "--rank-pattern",
    default="",
    metavar="KEY=R,...",
    help="per-module ranks as PEFT's rank_pattern (KEY: a regex for a dotted suffix of the module path, "
    "e.g. q_proj=4,lm_head=16; the parameter path for 3D experts)",
)
@click.option("--alpha-pattern", default="", metavar="KEY=A,...", help="per-module alphas (PEFT's alpha_pattern)")
def adapters_gen(model, out, groups, rank, alpha, seed, layout, rslora, rank_pattern, alpha_pattern) -> int:
    """Write a seeded random adapter for a catalog model (groups: attention, experts, ..., lm_head, embed_tokens)."""
    import torch

    from lpdiff.harness.spec import adapters as ad
    from lpdiff.harness.spec.catalog import load_hf_model
    from lpdiff.harness.spec.resolve import resolve

    hf = load_hf_model(resolve(model, adapters=()).spec, torch.float32, "cpu")
    ad.generate_adapter(
        hf,
        out,
        groups=groups.split(","),
        rank=rank,
        alpha=alpha,
        seed=seed,
        layout=layout,
        use_rslora=rslora,
        rank_pattern=_pattern_option("--rank-pattern", rank_pattern, int),
        alpha_pattern=_pattern_option("--alpha-pattern", alpha_pattern, float),
    )
    click.echo(f"wrote {out}")
    return EXIT_OK


def _pattern_option(flag: str, text: str, cast) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = cast(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise click.BadParameter(
                f"{item!r}: give KEY={'R' if cast is int else 'ALPHA'} pairs separated by "
                "commas, e.g. q_proj=4,lm_head=16",
                param_hint=flag,
            )
    return out


@adapters.command("convert")
@click.option("--model", required=True, help="catalog model, checkpoint directory or Hub id ORG/NAME[@REV]")
@click.argument("src")
@click.argument("dst")
@click.option("--to", type=LAYOUTS, required=True)
@click.option(
    "--disk-root",
    default=None,
    metavar="ROOT",
    help="write the decoder's modules under ROOT instead of 'model' (e.g. model.language_model: the "
    "names vLLM reads on a Qwen3.5 checkpoint; backbone: Nemotron-H's on-disk name)",
)
def adapters_convert(model, src, dst, to, disk_root) -> int:
    """Rewrite an adapter in another expert layout (checked against PEFT's merge in the tests)."""
    from lpdiff.harness.spec import adapters as ad
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.spec.resolve import resolve

    ad.convert_adapter(
        src, dst, to=to, model_config=hf_config(resolve(model, adapters=(), weights=False).spec), disk_root=disk_root
    )
    click.echo(f"wrote {dst}")
    return EXIT_OK


@cli.command()
@click.option("--model", "models", multiple=True, help="model (repeatable; default: the tiny MoE zoo)")
@click.option("--engine", default=None, help="with --against: calibrate one pair instead of the zoo plan")
@click.option("--dtype", type=DTYPES, default="float32")
@click.option("--option", "options", multiple=True, help="engine option KEY=VALUE for --engine")
@click.option("--against", default="hf")
@click.option("--against-dtype", type=DTYPES, default="float32")
@click.option("--against-option", "against_options", multiple=True)
@click.option(
    "--record-as",
    multiple=True,
    metavar="PAIR@DTYPE",
    help="threshold entry to write, e.g. vllm:bfloat16-vs-hf:float32@bfloat16",
)
@click.option("--factor", type=float, default=10.0)
@click.option("--tp", type=click.IntRange(min=1), default=1)
@click.option("--num-layers", type=click.IntRange(min=1), default=None)
def calibrate(
    models, engine, dtype, options, against, against_dtype, against_options, record_as, factor, tp, num_layers
) -> int:
    """Measure noise floors between correct implementations and record thresholds from them."""
    from lpdiff.harness.commands import calibrate as cal
    from lpdiff.harness.spec.adapter_zoo import MOE_MODELS

    models = list(models) or MOE_MODELS
    if engine is None:
        cal.calibrate_zoo(models)
        return EXIT_OK
    if not record_as:
        raise click.UsageError("--engine needs --record-as PAIR@DTYPE (which threshold entry the noise sets)")
    a = cal.Lane(engine, dtype, parse_options(options), tp)
    b = cal.Lane(against, against_dtype, parse_options(against_options))
    targets = [tuple(r.rsplit("@", 1)) for r in record_as]
    for m in models:
        cal.calibrate(m, a, b, targets, factor, tp=tp, num_layers=num_layers)
    return EXIT_OK


@cli.command()
@click.option("--engine", required=True, type=click.Choice(list(ENGINES)))
@click.option("--model", "models", multiple=True, required=True, help="catalog model (repeatable)")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="depth cut (full width)")
@click.option("--tp", type=click.IntRange(min=1), default=1)
@click.option("--reference", type=click.Choice(["hf", "triton"]), default="hf")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option(
    "--k", type=click.IntRange(min=2), default=3, show_default=True, help="runs of the engine under test (rerun noise)"
)
@click.option("--device", default="cuda", show_default=True)
@click.option("--csv", "csv_path", default=None, help="append one row per lane to this CSV")
@click.option("--workdir", default=None, help="where adapters are written (default: a temporary directory)")
@click.option("--baselines", default=None, help="store for the reference runs (default: $LPDIFF_BASELINES or lpdiff's)")
@click.option(
    "--init-recipe",
    default=None,
    help="a config-built model's weights: hf-init-bf16/v1 or peaked/v1 "
    "(default: $LPDIFF_INIT_RECIPE, else hf-init-bf16/v1)",
)
@click.option(
    "--routing-replay",
    is_flag=True,
    help="judge against the hf reference run with the engine's expert "
    "ids forced; routing flips judged apart (harness/commands/replay.py)",
)
@click.option(
    "--decode",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="also a decode verdict: N "
    "generated tokens per prompt and lane, judged with this check's measured threshold (commands/decode.py)",
)
@click.option("--sampling", type=click.Choice(["greedy", "seeded"]), default="greedy", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
def check(
    engine,
    models,
    layers,
    tp,
    reference,
    dtype,
    k,
    device,
    csv_path,
    workdir,
    baselines,
    init_recipe,
    routing_replay,
    decode=None,
    sampling="greedy",
    seed=0,
) -> int:
    """A bf16 engine vs an fp32 reference on a full-width model; thresholds from noise measured in the same run."""
    import tempfile

    from lpdiff.harness.commands import check as chk
    from lpdiff.harness.commands.replay import checker
    from lpdiff.harness.pipeline.references import default_store

    _need_engine(engine)
    run = checker(routing_replay, reference, default_store(baselines))  # run_check, or replay_check
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            case = chk.build_case(
                model, layers, Path(workdir or tmp) / model, device=device, log=_log, init_recipe=init_recipe
            )
            res = run(case, engine, tp, reference, k, dtype=dtype, log=_log)
            click.echo(chk.format_result(res))
            if csv_path:
                chk.write_csv(res, csv_path)
            ok &= res.as_expected
            if decode is not None and res.threshold is not None:
                from lpdiff.harness.commands.decode import check_case_decode, format_decode

                d = check_case_decode(
                    case, engine, res.threshold, tp, dtype, reference, decode, sampling, seed, log=_log
                )
                click.echo(format_decode(d))
                ok &= d.passed
    return EXIT_OK if ok else EXIT_FAILED


@cli.command()
@click.argument("model")
@click.argument("adapter")
@click.option("--engine", default="hf", show_default=True)
@click.option("--dtype", type=DTYPES, default="float32", show_default=True)
@click.option("--tp", type=click.IntRange(min=1), default=1)
@click.option("--num-layers", type=click.IntRange(min=1), default=None)
@click.option("--prompt-set", default="default")
@click.option("--relation", "relations", multiple=True, help="relation (repeatable; default: all)")
@click.option("--k", type=click.IntRange(min=2), default=2, show_default=True, help="reruns for the noise")
@click.option("--factor", type=float, default=None, help="FAIL when ratio > this (default: by dtype)")
@click.option("--option", "options", multiple=True, help="engine option KEY=VALUE (repeatable)")
@click.option("--csv", "csv_path", default=None, help="append the rows to this CSV")
def metamorphic(
    model, adapter, engine, dtype, tp, num_layers, prompt_set, relations, k, factor, options, csv_path
) -> int:
    """An engine against itself on inputs that must give equal logprobs."""
    from lpdiff.harness.commands import metamorphic as mm
    from lpdiff.harness.spec.resolve import resolve

    _need_engine(engine)
    r = resolve(model, adapters=(adapter,), prompts=prompt_set, num_layers=num_layers)
    adapter_dir = next(iter(r.adapters.values())).path
    unknown = [x for x in relations if x not in mm.RELATIONS]
    if unknown:
        raise click.BadParameter(
            f"unknown relation(s) {unknown}; known: {', '.join(mm.RELATIONS)}", param_hint="--relation"
        )
    rep = mm.run_metamorphic(
        engine,
        r.spec,
        adapter_dir,
        r.prompts,
        adapter_name=next(iter(r.adapters)),
        dtype=dtype,
        tp=tp,
        options=parse_options(options),
        relations=list(relations) or None,
        k=k,
        factor=factor,
        log=_log,
    )
    click.echo(mm.format_report(rep))
    if csv_path:
        mm.write_csv(rep, csv_path)
    return EXIT_FAILED if rep.failed else EXIT_OK


@cli.command()
@click.argument("model")
@click.argument("adapter")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    type=click.Choice(list(ENGINES)),
    help="check only this engine (repeatable; default: every engine doctor knows: hf, vllm, sglang)",
)
@click.option(
    "--max-lora-rank",
    type=click.IntRange(min=1),
    default=None,
    help="the max_lora_rank vllm/sglang will be started with (default: sized from the adapter)",
)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def doctor(model, adapter, engines, max_lora_rank, as_json) -> int:
    """What each engine will refuse or silently ignore in an adapter, before any run (exit 1 if anything)."""
    from lpdiff.harness.commands import doctor as dr

    limits = dict.fromkeys(dr.RANK_LIMITED, max_lora_rank) if max_lora_rank else None
    report = dr.doctor(model, adapter, list(engines) or None, limits)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else dr.format_report(report))
    return report.exit_code


@cli.command()
@click.argument("model")
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    help="zoo adapter name or PEFT directory run by both engines (default: every zoo adapter, as lpdiff "
    "run); repeatable: several run as one mixed batch with base rows, and a finding names the adapter",
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    multiple=True,
    help="the triton runtime's tensor-parallel size (repeatable; default: lpdiff run's, TP 1 and 2 here; HF runs TP 1)",
)
@click.option("--fault", default=None, help="bug-zoo fault injected into the triton runtime (kernels/faults.py)")
@click.option(
    "--factor", type=float, default=None, help="how far above the noise floor a module must be (default: bisect.FACTOR)"
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="prompts per adapter (default: 8 rows over the batch, at least 2 per adapter)",
)
def bisect(model, adapters, tp, fault, factor, num_prompts) -> int:
    """First layer + module (+ adapter) where the triton runtime leaves HF+PEFT (floor: HF's two expert kernels)."""
    from lpdiff.harness.commands import bisect as bs
    from lpdiff.kernels.faults import runtime_faults

    if fault is not None and fault not in runtime_faults():
        raise click.BadParameter(
            f"invalid choice: {fault!r} (choose from {', '.join(runtime_faults())})", param_hint="--fault"
        )
    res = bs.bisect(model, adapters, fault, bs.FACTOR if factor is None else factor, num_prompts, tp or None)
    click.echo(res.table())
    click.echo(res.summary())
    return EXIT_FAILED if res.finding else EXIT_OK


cli.add_command(baselines)
cli.add_command(report)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the exit-code contract lives here, so every command keeps it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = cli.main(args=argv, prog_name="lpdiff", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:  # usage errors: unknown option, bad value, missing argument
        e.show()
        return EXIT_USAGE
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        _log("aborted")
        return 128 + signal.SIGINT  # the shell's code for a SIGINT death (130), never a FAIL's 1
    except InputError as e:  # bad input, whatever layer found it: one line naming the fix
        _log(f"error: {e}")
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 - a bug in lpdiff: show everything
        traceback.print_exc()
        _log("error: lpdiff crashed (the traceback above is a bug; please report it)")
        return EXIT_CRASH
    return EXIT_OK if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
