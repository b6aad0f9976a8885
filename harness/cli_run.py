"""``lpdiff run`` and ``lpdiff regen``: the options that pick what they compute, one ``RunRequest`` built from
them (commands/run.py), and the table, JSON and exit code of the report."""

from __future__ import annotations

from pathlib import Path

import click

from lpdiff.engines import DEFAULT_ENGINE, ENGINES, REFERENCE_ENGINE
from lpdiff.harness.cli_common import DTYPES, ENGINE, EXIT_FAILED, EXIT_OK, log, need_engine, parse_options, progress
from lpdiff.harness.spec.errors import UsageError


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
            type=ENGINE,
            default=None,
            help=f"engine under test, one of {', '.join(ENGINES)} (run's default: {DEFAULT_ENGINE}, lpdiff's own; "
            f"{REFERENCE_ENGINE} against its own stored runs is the install self-check; regen's default: the "
            "reference)",
        ),
        click.option("--dtype", type=DTYPES, default="float32", show_default=True),
        click.option(
            "--reference",
            type=ENGINE,
            default=REFERENCE_ENGINE,
            show_default=True,
            help="engine of the stored reference runs",
        ),
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
        click.option("--top-k", type=click.IntRange(min=0), default=8, help="top-k logprobs kept and compared [8]"),
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


def decode_options(decode_help: str):
    """``--decode N``, ``--sampling`` and ``--seed``: a decode verdict beside a command's prefill ones
    (commands/decode.py); ``decode_help`` says what --decode adds to this command."""
    opts = [
        click.option("--decode", type=click.IntRange(min=1), default=None, metavar="N", help=decode_help),
        click.option(
            "--sampling",
            type=click.Choice(["greedy", "seeded"]),
            default="greedy",
            show_default=True,
            help="with --decode: argmax, or a seeded draw from the raw distribution",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="with --decode --sampling seeded: prompt i uses seed + i",
        ),
    ]

    def wrap(f):
        for o in reversed(opts):
            f = o(f)
        return f

    return wrap


def _prompt_source(prompts, split, column, count, seed):
    from lpdiff.harness.spec.prompt_sources import PromptSource

    if prompts is None:
        if column or count or seed is not None or split != "train":
            raise click.UsageError("--prompts-split/-column/-count/-seed need --prompts")
        return None
    return PromptSource(prompts, split, column, count, seed)


def _request(regen: bool, kw: dict):
    """The parsed options as the one ``RunRequest`` (commands/run.py) that run, regen and run --decode read."""
    from lpdiff.harness.commands.run import RunRequest

    same = ("engine", "dtype", "reference", "ref_dtype", "prompt_set", "top_k", "num_layers", "baselines", "save_runs")
    return RunRequest(
        regen=regen,
        models=tuple(kw["models"]),
        tps=tuple(kw["tps"]),
        adapters=tuple(kw["adapters"]),
        prompts=_prompt_source(
            kw["prompts"], kw["prompts_split"], kw["prompts_column"], kw["prompts_count"], kw["prompts_seed"]
        ),
        options=parse_options(kw["options"]),
        **{k: kw[k] for k in same},
    )


def _run_or_regen(regen: bool, kw: dict) -> int:
    from lpdiff.harness.commands.run import run, what_it_judges
    from lpdiff.harness.pipeline.report import verdict_table
    from lpdiff.harness.pipeline.verdict import to_json

    rep = run(_request(regen, kw), log=log, progress=lambda jobs: progress(jobs, "regen" if regen else "run"))
    if not regen:
        click.echo(what_it_judges(rep.plan.jobs[0]))
    click.echo(verdict_table(rep.verdicts, wide=kw["wide"]))
    if kw["json_path"]:
        Path(kw["json_path"]).write_text(to_json(rep.verdicts))
    if regen:
        return EXIT_OK
    log(rep.summary())
    return EXIT_FAILED if rep.failed else EXIT_OK


def _run_decode(n: int, sampling: str, seed: int, kw: dict) -> int:
    from lpdiff.harness.commands.decode import decode_jobs

    r = _request(False, kw)
    ok = decode_jobs(
        r.engine or DEFAULT_ENGINE,
        r.models,
        r.tps,
        r.dtype,
        r.adapters or None,
        r.prompts or r.prompt_set,
        r.num_layers,
        r.options,
        r.reference,
        r.ref_dtype,
        n,
        sampling,
        seed,
        need_engine,
        click.echo,
        log,
    )
    return EXIT_OK if ok else EXIT_FAILED


@click.command(
    help=f"Judge an engine against stored reference runs (the default command; default engine: {DEFAULT_ENGINE}, "
    f"lpdiff's own, against the stored {REFERENCE_ENGINE} runs; --engine {REFERENCE_ENGINE} is the install "
    "self-check)."
)
@selection
@click.option(
    "--case",
    default=None,
    help="judge against a trainer test case: DIR or hf://datasets/ORG/NAME[@REV] "
    "(adapter + compare_sample_train_data.pt or reference.jsonl/.parquet; docs/cases.md)",
)
@decode_options(
    "decode verdict: the engine generates N tokens per prompt with its own logprobs, the reference scores prompt + "
    "generated by prefill (commands/decode.py)"
)
def run(case=None, decode=None, sampling="greedy", seed=0, **kw) -> int:
    if decode is not None:
        if case:
            raise UsageError("--decode judges generated tokens against a prefill reference; --case has its own")
        return _run_decode(decode, sampling, seed, kw)
    if case:
        from lpdiff.harness.commands.case import run_case

        kw["engine"] = kw["engine"] or DEFAULT_ENGINE
        need_engine(kw["engine"])
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
    return _run_or_regen(False, kw)


@click.command()
@selection
def regen(**kw) -> int:
    """(Re)compute reference runs and write them to the store (nothing else is touched)."""
    return _run_or_regen(True, kw)
