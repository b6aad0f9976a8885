"""Decode verdicts (``lpdiff run --decode N``, ``lpdiff check --decode N``): the engine generates N tokens per prompt
and reports its own logprob of each (what an RL rollout samples with); the reference scores the same full
sequences (prompt + generated) by prefill (what the trainer computes); the verdict covers the generated positions.

Every prompt runs under every lane (base and each adapter) in one mixed batch, greedy or seeded sampling. Per lane:
the RL mismatch metrics (pipeline/rl_metrics.py: token k1 / k3, sequence-level k3 mean and max, the share outside
IcePop's [0.5, 2] ratio band) beside lpdiff's own k2 and max |d|. PASS needs every logprob finite (a non-finite one
is a FAIL naming the lane, prompt and generated position) and k2 and max |d| within the threshold the prefill verdict
of the same engine pair uses (``lpdiff run``: the recorded thresholds; ``lpdiff check``: the one measured in that
run): decoding must agree with a prefill of the same tokens as closely as two prefills do. The RL metrics are
reported, not thresholded. Engines without a decode of their own (the triton runtime, prefill-only) decode greedily
by re-prefilling each step (engines.base.decode_by_prefill); seeded sampling is refused there.

Each lane has an expected verdict, as the prefill check's lanes do: ``lpdiff check --decode`` and the GPU grid serve
the check case's ``broken`` adapter (every expert's LoRA-B shifted one expert) while the reference scores the
engine's sequences with the correct adapter it was made from; that lane must FAIL, or the decode verdict could not
see an expert-ordering bug. A result is ``as_expected`` when every lane's verdict is its expectation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lpdiff.engines import REFERENCE_ENGINE
from lpdiff.engines.base import EngineConfig, decode, open_engine
from lpdiff.harness.pipeline.metrics import nonfinite_reason
from lpdiff.harness.pipeline.rl_metrics import DecodeMetrics, decode_metrics
from lpdiff.harness.pipeline.thresholds import Threshold
from lpdiff.harness.types import AdapterSpec, ModelSpec


@dataclass(slots=True)
class DecodeLane:
    lane: str  # "base" or the adapter's name
    metrics: DecodeMetrics
    passed: bool
    reasons: list[str] = field(default_factory=list)
    expected: str = "PASS"  # "FAIL": the lane serves a deliberately broken adapter (the check case's "broken")


def unexpected(lanes: Sequence[DecodeLane]) -> list[DecodeLane]:
    """The lanes whose verdict is not their expectation, by the prefill verdicts' rule (report.outcome)."""
    from lpdiff.harness.pipeline.report import outcome

    return [ln for ln in lanes if outcome(ln).endswith("(unexpected)")]


@dataclass(slots=True)
class DecodeResult:
    model: str
    engine: str
    reference: str
    dtype: str
    ref_dtype: str
    tp: int
    max_new_tokens: int
    sampling: str
    seed: int
    how: str  # "decode" (the engine's own) or "re-prefill"
    engine_version: str
    threshold: Threshold
    lanes: list[DecodeLane]
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        """Every lane passed (a result with a broken lane never does: see ``as_expected``)."""
        return all(lane.passed for lane in self.lanes)

    @property
    def as_expected(self) -> bool:
        """Every lane's verdict is its expectation: the correct lanes PASS, the broken one FAILs."""
        return not unexpected(self.lanes)


def judge_lane(lane: str, m: DecodeMetrics, t: Threshold, expected: str = "PASS") -> DecodeLane:
    reasons = []
    if m.num_nonfinite:  # the prefill verdicts' rule and wording (metrics.nonfinite_reason)
        reasons.append(
            nonfinite_reason(
                m.num_nonfinite,
                m.num_tokens + m.num_nonfinite,
                m.first_nonfinite,
                lane,
                "prompt",  # a lane's sequence i is prompt i's continuation (run_decode)
                "generated position",
            )
        )
    if m.num_tokens and m.k2 > t.k2:
        reasons.append(f"k2 {m.k2:.3g} > {t.k2:.3g}")
    if m.num_tokens and m.max_abs > t.max_abs:
        reasons.append(f"max |d| {m.max_abs:.3g} > {t.max_abs:.3g}")
    return DecodeLane(lane, m, not reasons, reasons, expected)


def run_decode(
    spec: ModelSpec,
    adapters: dict[str, AdapterSpec],
    prompts: Sequence[Sequence[int]],
    engine: str,
    threshold: Threshold,
    dtype: str = "float32",
    tp: int = 1,
    options: dict | None = None,
    reference: str = REFERENCE_ENGINE,
    ref_dtype: str = "float32",
    max_new_tokens: int = 16,
    sampling: str = "greedy",
    seed: int = 0,
    ref_adapters: dict[str, AdapterSpec] | None = None,
    ref_options: dict | None = None,
    log: Callable[[str], None] = print,
    expected: Mapping[str, str] | None = None,
) -> DecodeResult:
    """``adapters``: lane name -> the file the engine reads; ``ref_adapters``: the reference's files of the same
    lanes (default: the same files); ``expected``: lane name -> its expected verdict (default: every lane PASS)."""
    from lpdiff.harness.pipeline.session import engine_options

    lanes: list[str | None] = [None, *adapters]
    seqs = [list(p) for p in prompts for _ in lanes]
    choice = [lane for _ in prompts for lane in lanes]
    cfg = EngineConfig(spec, dict(adapters), dtype=dtype, tp=tp, options={**engine_options(engine), **(options or {})})
    t0 = time.perf_counter()
    with open_engine(engine, cfg) as eng:
        version = eng.version()
        gens, how = decode(eng, seqs, choice, max_new_tokens, sampling, seed)
    wall = time.perf_counter() - t0
    log(
        f"[decode] {engine} {dtype} tp={tp}: {len(seqs)} sequences x {max_new_tokens} tokens ({how}, {sampling}) "
        f"in {wall:.1f}s"
    )
    rcfg = EngineConfig(
        spec,
        dict(ref_adapters or adapters),
        dtype=ref_dtype,
        options={**engine_options(reference), **(ref_options or {})},
    )
    with open_engine(reference, rcfg) as ref:
        scored = ref.prompt_logprobs([g.sequence for g in gens], choice)
    out = []
    for lane in lanes:
        idx = [i for i, c in enumerate(choice) if c == lane]
        m = decode_metrics([gens[i].logprobs for i in idx], [scored[i].logprobs[-max_new_tokens:] for i in idx])
        out.append(judge_lane(lane or "base", m, threshold, (expected or {}).get(lane or "base", "PASS")))
    return DecodeResult(
        spec.name,
        engine,
        reference,
        dtype,
        ref_dtype,
        tp,
        max_new_tokens,
        sampling,
        seed,
        how,
        version,
        threshold,
        out,
        wall,
    )


def format_decode(res: DecodeResult) -> str:
    """The verdict line (PASS / FAIL; "as expected" / "NOT AS EXPECTED" where a lane must FAIL), the threshold, one
    row per lane, then one line per lane that did not come out as expected, naming it and why."""
    from lpdiff.harness.pipeline.report import outcome, table

    if any(ln.expected != "PASS" for ln in res.lanes):
        word = "as expected" if res.as_expected else "NOT AS EXPECTED"
    else:
        word = "PASS" if res.passed else "FAIL"
    head = (
        f"decode verdict: {res.engine} {res.dtype} (tp={res.tp}, {res.how}, {res.sampling}"
        f"{f' seed {res.seed}' if res.sampling == 'seeded' else ''}, {res.max_new_tokens} tokens) vs "
        f"{res.reference} {res.ref_dtype} prefill on {res.model}: {word}\n"
        f"threshold: k2 {res.threshold.k2:.3g}, max |d| {res.threshold.max_abs:.3g} ({res.threshold.provenance}); "
        "k1, k3: token means of the log-ratio estimators (KL(engine || reference)); seq k3: per-sequence mean "
        "k3, mean and max over sequences; band: share of tokens with ratio outside [0.5, 2]"
    )
    cols = ["lane", "tokens", "k1", "k3", "seq k3 mean", "seq k3 max", "band", "k2", "max |d|", "expected", "verdict"]
    rows = [
        [
            ln.lane,
            ln.metrics.num_tokens,
            f"{ln.metrics.k1:.3g}",
            f"{ln.metrics.k3:.3g}",
            f"{ln.metrics.seq_k3_mean:.3g}",
            f"{ln.metrics.seq_k3_max:.3g}",
            f"{ln.metrics.outside_band:.3g}",
            f"{ln.metrics.k2:.3g}",
            f"{ln.metrics.max_abs:.3g}",
            ln.expected,
            f"{outcome(ln)}: {'; '.join(ln.reasons)}" if ln.reasons else outcome(ln),
        ]
        for ln in res.lanes
    ]
    bad = [
        f"lane {ln.lane}: expected {ln.expected}, got "
        + (f"FAIL: {'; '.join(ln.reasons)}" if not ln.passed else "PASS: the verdict did not see a broken adapter")
        for ln in unexpected(res.lanes)
    ]
    return "\n".join([head, table(rows, cols), *bad])


def decode_jobs(
    engine: str,
    models: Sequence[str],
    tps: Sequence[int],
    dtype: str,
    adapters,
    prompts,
    num_layers: int | None,
    options: dict,
    reference: str,
    ref_dtype: str,
    n: int,
    sampling: str,
    seed: int,
    need_engine: Callable[[str], None],
    echo: Callable[[str], None],
    log: Callable[[str], None],
) -> bool:
    """``lpdiff run --decode N``: every model the engine serves (default: the tiny zoo) x TP size (default: run's),
    each model resolved once as ``lpdiff run`` resolves it (model, adapters, prompts), judged with the recorded
    threshold of the engine pair (thresholds.lookup); prints each result, True when all pass. The user's adapters
    pass doctor's preflight first: the engine's decode refusals, the reference's prefill ones (it scores by
    prefill)."""
    from lpdiff.harness.commands.preflight import preflight
    from lpdiff.harness.commands.run import default_tps, zoo_models
    from lpdiff.harness.pipeline.thresholds import lookup
    from lpdiff.harness.spec.resolve import resolve

    need_engine(engine)
    chosen, skipped = zoo_models(engine, models)
    ok = True
    pair = f"{engine}:{dtype}-vs-{reference}:{ref_dtype}"
    for model in chosen:
        r = resolve(model, adapters, prompts, num_layers)
        preflight(r, [engine], log, verdict="decode")
        preflight(r, [reference], log)
        for tp in dict.fromkeys(tps or default_tps(engine)):
            t = lookup(r.spec.name, pair, dtype, tp)
            res = run_decode(
                r.spec,
                r.adapters,
                r.prompts,
                engine,
                t,
                dtype,
                tp,
                options,
                reference,
                ref_dtype,
                n,
                sampling,
                seed,
                log=log,
            )
            echo(format_decode(res))
            ok &= res.as_expected
    for model, why in skipped:
        log(f"skipped {model}: {why}")
    return ok


def check_case_decode(
    case,
    engine: str,
    threshold: Threshold,
    tp: int = 1,
    dtype: str = "bfloat16",
    reference: str = REFERENCE_ENGINE,
    max_new_tokens: int = 16,
    sampling: str = "greedy",
    seed: int = 0,
    options: dict | None = None,
    log: Callable[[str], None] = print,
) -> DecodeResult:
    """``lpdiff check --decode N`` and the GPU grid's decode lane: the check case's adapters in one layout the engine
    reads (those doctor does not refuse for a decode verdict), the reference on PEFT 3D files in fp32, ``threshold``
    from the check of the same engine and dtype. The broken lane is served its broken file and scored by the
    reference with the correct file of its ``broken_from`` adapter (the prefill check's rule): it is expected to FAIL,
    every other lane to PASS (``DecodeResult.as_expected``)."""
    from lpdiff.engines.base import layouts_for
    from lpdiff.harness.commands.check import refused_lanes, served_files
    from lpdiff.harness.pipeline.noise import REFERENCE_DTYPE

    layout = layouts_for(engine, case.spec.arch)[:1]
    lanes = served_files(case, engine, layout)
    refused = refused_lanes(case, engine, lanes, "decode")
    served, ref_files, expected = {}, {}, {}
    for lane, spec in lanes.items():
        name, plan = lane.split(".")[0], case.plans[lane.split(".")[0]]
        if lane in refused:
            log(f"[decode] {engine}: lane {name} not served ({refused[lane]})")
            continue
        served[name] = AdapterSpec(name, spec.path)
        ref_files[name] = AdapterSpec(name, case.files[(plan.broken_from or name, "peft3d")].path)
        expected[name] = plan.expected
    return run_decode(
        case.spec,
        served,
        case.prompts,
        engine,
        threshold,
        dtype,
        tp,
        options,
        reference,
        REFERENCE_DTYPE,
        max_new_tokens,
        sampling,
        seed,
        ref_adapters=ref_files,
        log=log,
        expected=expected,
    )


DECODE_CSV_COLUMNS = (
    "date",
    "commit",
    "gpu",
    "engine_version",
    "model",
    "tp",
    "dtype",
    "engine",
    "reference",
    "ref_dtype",
    "how",
    "sampling",
    "seed",
    "tokens_per_prompt",
    "lane",
    "tokens",
    "k1",
    "k3",
    "seq_k3_mean",
    "seq_k3_max",
    "outside_band",
    "k2",
    "max_abs",
    "nonfinite",
    "threshold_k2",
    "threshold_max",
    "verdict",
    "reasons",
    "expected",
)


def write_decode_csv(res: DecodeResult, path) -> None:
    """One row per lane (benchmarks/results/engines_gpu_decode.csv beside the check's engines_gpu.csv), appended to
    ``path`` unless its header is another (report.append_csv)."""
    import datetime

    from lpdiff.harness.pipeline.provenance import device_name, git_commit
    from lpdiff.harness.pipeline.report import append_csv

    head = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "gpu": device_name(),
        "engine_version": res.engine_version,
        "model": res.model,
        "tp": res.tp,
        "dtype": res.dtype,
        "engine": res.engine,
        "reference": res.reference,
        "ref_dtype": res.ref_dtype,
        "how": res.how,
        "sampling": res.sampling,
        "seed": res.seed,
        "tokens_per_prompt": res.max_new_tokens,
        "threshold_k2": f"{res.threshold.k2:.4g}",
        "threshold_max": f"{res.threshold.max_abs:.4g}",
    }
    rows = [
        {
            **head,
            "lane": ln.lane,
            "tokens": ln.metrics.num_tokens,
            "k1": f"{ln.metrics.k1:.4g}",
            "k3": f"{ln.metrics.k3:.4g}",
            "seq_k3_mean": f"{ln.metrics.seq_k3_mean:.4g}",
            "seq_k3_max": f"{ln.metrics.seq_k3_max:.4g}",
            "outside_band": f"{ln.metrics.outside_band:.4g}",
            "k2": f"{ln.metrics.k2:.4g}",
            "max_abs": f"{ln.metrics.max_abs:.4g}",
            "nonfinite": ln.metrics.num_nonfinite,
            "verdict": "PASS" if ln.passed else "FAIL",
            "reasons": "; ".join(ln.reasons)[:300],
            "expected": ln.expected,
        }
        for ln in res.lanes
    ]
    append_csv(path, DECODE_CSV_COLUMNS, rows)
