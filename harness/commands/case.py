"""``lpdiff run --case``: judge an engine against a trainer test case the way SGLang's trainer-reference tests do.

The engine computes prompt logprobs for the case's tokens with the case's adapter and without it. Verdict: PASS
when kl_v2(trainer, engine) = 0.5·mean(d²) (lpdiff's k2) is at most the case threshold *and* the adapter changes
the output (base and LoRA logprobs not identical). Shown beside it: the case's own noise, kl_v2(trainer, original
sampler); kl_v2(engine, original sampler); the base-vs-LoRA difference; every other lpdiff metric of engine vs
trainer. Exit 0 PASS, 1 FAIL.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lpdiff.harness.pipeline.metrics import Metrics, compare
from lpdiff.harness.pipeline.session import run_session
from lpdiff.harness.spec.cases import TrainerCase, check_vocab, load_case
from lpdiff.harness.types import AdapterSpec, LogprobRun, PromptLogprobs

CASE_ADAPTER = "case"


@dataclass(slots=True)
class CaseVerdict:
    case: str
    model: str
    engine: str
    dtype: str
    tp: int
    threshold: float
    kl_v2_engine_trainer: float
    kl_v2_sampler_trainer: float | None  # the case's own noise
    kl_v2_engine_sampler: float | None
    lora_vs_base_mean_abs: float
    lora_vs_base_max_abs: float
    adapter_changes_output: bool
    metrics: Metrics  # engine (with adapter) vs trainer
    passed: bool
    reason: str


def _run(prompts: list[list[int]], values: list[np.ndarray], who: str) -> LogprobRun:
    return LogprobRun([PromptLogprobs(np.asarray(p), v) for p, v in zip(prompts, values)], {"engine": who})


def judge_case(
    case: TrainerCase, spec, engine: str, dtype: str = "bfloat16", tp: int = 1, options: dict | None = None
) -> CaseVerdict:
    from lpdiff.harness.spec.catalog import hf_config

    check_vocab(case, hf_config(spec).get_text_config().vocab_size)
    lanes = run_session(
        engine,
        spec,
        {CASE_ADAPTER: AdapterSpec(CASE_ADAPTER, str(case.adapter_dir))},
        case.prompts,
        dtype,
        tp=tp,
        options=options,
    ).first
    lora, base = lanes[CASE_ADAPTER], lanes[None]
    trainer = _run(case.prompts, case.training, "trainer")
    m = compare(lora, trainer)
    delta = compare(lora, base)
    noise = compare(_run(case.prompts, case.sampling, "sampler"), trainer).k2 if case.sampling else None
    vs_sampler = compare(lora, _run(case.prompts, case.sampling, "sampler")).k2 if case.sampling else None
    changes = delta.max_abs > 0
    ok = m.k2 <= case.threshold and changes and m.num_nonfinite == 0
    reason = (
        ""
        if ok
        else "; ".join(
            r
            for r in (
                f"kl_v2(trainer, engine) {m.k2:.3e} > {case.threshold:.1e}" if m.k2 > case.threshold else "",
                "the adapter does not change the output (LoRA logprobs equal the base model's)" if not changes else "",
                f"{m.num_nonfinite} non-finite logprobs" if m.num_nonfinite else "",
            )
            if r
        )
    )
    return CaseVerdict(
        case.source,
        spec.name,
        engine,
        dtype,
        tp,
        case.threshold,
        m.k2,
        noise,
        vs_sampler,
        delta.mean_abs,
        delta.max_abs,
        changes,
        m,
        ok,
        reason,
    )


def format_verdict(v: CaseVerdict) -> str:
    from tabulate import tabulate

    def e(x):
        return "-" if x is None else f"{x:.3e}"

    rows = [
        ["kl_v2(trainer, engine)", e(v.kl_v2_engine_trainer), f"<= {v.threshold:.1e}"],
        ["kl_v2(trainer, original sampler)", e(v.kl_v2_sampler_trainer), "the case's own noise"],
        ["kl_v2(engine, original sampler)", e(v.kl_v2_engine_sampler), ""],
        [
            "LoRA vs base mean |d| / max |d|",
            f"{v.lora_vs_base_mean_abs:.3e} / {v.lora_vs_base_max_abs:.3e}",
            "must be > 0",
        ],
    ]
    m = v.metrics
    rows += [
        [f"engine vs trainer {k}", e(getattr(m, k)), ""]
        for k in ("k1", "k3", "max_abs", "mean_abs", "p99_abs", "over_0_1", "over_0_5", "over_1_0")
    ]
    head = (
        f"{'PASS' if v.passed else 'FAIL'}  case {v.case}  model {v.model}  engine {v.engine} {v.dtype} "
        f"tp {v.tp}  ({m.num_positions} positions)"
    )
    return "\n".join([head, tabulate(rows, headers=["", "value", ""]), *([v.reason] if v.reason else [])])


def case_model(name: str, num_layers: int | None = None, log=lambda s: None):
    """The case's base model, resolved as ``lpdiff run --model`` resolves it (spec/resolve.py): a catalog name, a
    checkpoint directory or a Hub id ORG/NAME[@REV]. A catalog model's own Hub id (``Qwen/Qwen3.5-35B-A3B``, what
    docs/cases.md and SGLang's cases name) is the real checkpoint when the HF cache holds it, and otherwise the
    catalog's config-built copy, said on ``log``: lpdiff cannot download a 35B checkpoint unasked."""
    from lpdiff.harness.spec import sources as src
    from lpdiff.harness.spec.catalog import HUB_REPOS, get_model
    from lpdiff.harness.spec.resolve import resolve_model

    ref = src.parse_hub(name)
    catalog = next(
        (
            n
            for n, repo in HUB_REPOS.items()
            if ref is not None
            and ref.repo_type == "model"
            and not ref.revision
            and not ref.subfolder
            and repo.lower() == ref.repo_id.lower()
        ),
        None,
    )
    if catalog is not None and ref is not None and not Path(name).expanduser().exists() and not _cached(ref.repo_id):
        log(
            f"--model {name}: not in the HF cache ({src.hub_cache()}); using the catalog's {catalog} (its config, "
            f"seeded random weights). A case trained on the real weights will FAIL on it: fetch them with "
            f"`{ref.fetch_command()}`"
        )
        return get_model(catalog, num_layers=num_layers)
    return resolve_model(name, num_layers)


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    from lpdiff.harness.spec import sources as src

    return isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=str(src.hub_cache())), str)


def run_case(
    source: str,
    model: str | None,
    engine: str,
    dtype: str,
    tp: int,
    num_layers: int | None,
    options: dict | None,
    json_path: str | None,
    echo,
) -> int:
    import sys

    from lpdiff.harness.spec.cases import DEFAULT_THRESHOLD, threshold_for
    from lpdiff.harness.spec.resolve import SpecError

    case = load_case(source)
    name = model or case.base_model
    if not name:
        raise SpecError(f"case {source} names no base model (case.json base_model); pass --model")
    spec = case_model(name, num_layers, lambda s: print(s, file=sys.stderr))
    if "kl_threshold" not in case.info and threshold_for(name) != DEFAULT_THRESHOLD:
        case.threshold = threshold_for(name)  # SGLang's threshold for the base model named on the command line
    v = judge_case(case, spec, engine, dtype, tp, options)
    echo(format_verdict(v))
    if json_path:
        Path(json_path).write_text(case_json(v))
    return 0 if v.passed else 1


def case_json(v: CaseVerdict) -> str:
    """The JSON ``run --case --json`` writes (``lpdiff report`` draws it as one lane)."""
    return json.dumps(asdict(v), indent=2, default=float) + "\n"
