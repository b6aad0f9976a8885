"""The faces that judge engines outside the stored-reference path: ``compare`` (two engines live, or two stored
runs), ``calibrate``, ``check`` (a full-width model, noise measured in the same run), ``metamorphic`` (an engine
against itself), ``doctor`` (what an engine refuses in an adapter) and ``bisect`` (where lpdiff's runtime leaves
the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from lpdiff.engines import REFERENCE_ENGINE
from lpdiff.engines.capabilities import VERDICTS
from lpdiff.harness.cli_common import DTYPES, ENGINE, EXIT_FAILED, EXIT_OK, log, need_engine, parse_options
from lpdiff.harness.cli_run import decode_options


@click.command()
@click.option(
    "--runs",
    nargs=2,
    type=click.Path(),
    default=None,
    metavar="A.npz B.npz",
    help="compare two stored runs instead of two live engines",
)
@click.option("--model", default=None)
@click.option("--engine", type=ENGINE, default=REFERENCE_ENGINE, show_default=True)
@click.option("--dtype", type=DTYPES, default="float32", show_default=True)
@click.option("--against", type=ENGINE, default=REFERENCE_ENGINE, show_default=True)
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
        path_a, path_b = runs  # click's nargs=2
        verdicts = [compare_runs(path_a, path_b, allow_different=allow_different)]
    elif model:
        for e in (engine, against):
            need_engine(e)
        verdicts = compare_live(
            model, engine, dtype, against, against_dtype, tp, adapter, test_adapter_dir, prompt_set, num_layers
        )
    else:
        raise click.UsageError("compare needs --model (two engines live) or --runs A.npz B.npz (two stored runs)")
    click.echo(verdict_table(verdicts))
    return EXIT_OK if all(v.passed for v in verdicts) else EXIT_FAILED


@click.command()
@click.option("--model", "models", multiple=True, help="model (repeatable; default: the tiny MoE zoo)")
@click.option("--engine", type=ENGINE, default=None, help="with --against: calibrate one pair instead of the zoo plan")
@click.option("--dtype", type=DTYPES, default="float32")
@click.option("--option", "options", multiple=True, help="engine option KEY=VALUE for --engine")
@click.option("--against", type=ENGINE, default=REFERENCE_ENGINE)
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
    from lpdiff.harness.build.adapter_zoo import MOE_MODELS
    from lpdiff.harness.commands import calibrate as cal

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


@click.command()
@click.option("--engine", required=True, type=ENGINE)
@click.option("--model", "models", multiple=True, required=True, help="catalog model (repeatable)")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="depth cut (full width)")
@click.option("--tp", type=click.IntRange(min=1), default=1)
@click.option("--reference", type=ENGINE, default=REFERENCE_ENGINE, help="the fp32 reference engine")
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
    help="judge against the reference run with the engine's expert "
    "ids forced; routing flips judged apart (harness/commands/replay.py)",
)
@decode_options(
    "also a decode verdict: N generated tokens per prompt and lane, judged with this check's measured threshold "
    "(commands/decode.py)"
)
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

    need_engine(engine)
    run = checker(routing_replay, reference, default_store(baselines))  # run_check, or replay_check
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            case = chk.build_case(
                model, layers, Path(workdir or tmp) / model, device=device, log=log, init_recipe=init_recipe
            )
            res = run(chk.CheckRequest(case, engine, tp, reference, k, dtype=dtype), log)
            click.echo(chk.format_result(res))
            if csv_path:
                chk.write_csv(res, csv_path)
            ok &= res.as_expected
            if decode is not None and res.threshold is not None:
                from lpdiff.harness.commands.decode import check_case_decode, format_decode

                d = check_case_decode(
                    case, engine, res.threshold, tp, dtype, reference, decode, sampling, seed, log=log
                )
                click.echo(format_decode(d))
                ok &= d.as_expected  # its broken lane must FAIL, as in the prefill check
    return EXIT_OK if ok else EXIT_FAILED


@click.command()
@click.argument("model")
@click.argument("adapter")
@click.option("--engine", type=ENGINE, default=REFERENCE_ENGINE, show_default=True)
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

    need_engine(engine)
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
        log=log,
    )
    click.echo(mm.format_report(rep))
    if csv_path:
        mm.write_csv(rep, csv_path)
    return EXIT_FAILED if rep.failed else EXIT_OK


@click.command()
@click.argument("model")
@click.argument("adapter")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    type=ENGINE,
    help="check only this engine (repeatable; default: every engine whose adapter handling doctor knows)",
)
@click.option(
    "--max-lora-rank",
    type=click.IntRange(min=1),
    default=None,
    help="the max_lora_rank the engines whose LoRA buffers are sized at start are started with "
    "(default: sized from the adapter)",
)
@click.option(
    "--verdict",
    type=click.Choice(VERDICTS),
    default=None,
    help="only the defects that break this verdict: prefill (prompt logprobs: lpdiff run, check) or decode (the "
    "engine's sampled logprobs: run/check --decode; e.g. vLLM's lm_head LoRA is refused for prefill only) "
    "(default: both)",
)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def doctor(model, adapter, engines, max_lora_rank, verdict, as_json) -> int:
    """What each engine will refuse or silently ignore in an adapter, before any run (exit 1 if anything)."""
    from lpdiff.harness.commands import doctor as dr

    limits = dict.fromkeys(dr.RANK_LIMITED, max_lora_rank) if max_lora_rank else None
    report = dr.doctor(model, adapter, list(engines) or None, limits, verdict)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "verdict": verdict or "all"}, indent=2))
    else:  # the scope under the report's first line: an lm_head finding holds for prefill only
        head, _, rest = dr.format_report(report).partition("\n")
        scope = f"{verdict} verdicts only" if verdict else "prefill and decode verdicts (--verdict asks one)"
        click.echo(f"{head}\n  for {scope}\n{rest}")
    return report.exit_code


@click.command()
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
