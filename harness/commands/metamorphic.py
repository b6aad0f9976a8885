"""``lpdiff metamorphic MODEL ADAPTER --engine E``: an engine against *itself* on inputs that must give the same
logprobs (docs/metrics.md, "Metamorphic verdicts"), judged against the engine's own rerun noise instead of a
reference's.

A relation turns the adapter (or the engine's settings, or the batch) into one or more *lanes*; each lane's
logprobs must equal those of its reference lane (the original adapter, or the base model, or another lane of the
same relation) up to the engine's own noise, of two kinds measured in the same run:
- rerun noise: the original lane and the base lane run ``k`` times; the largest max |Δ| between a rerun and the
  first run (0 for deterministic engines: SGLang 0.5.15, every base run, triton; small for vLLM 0.25.1 LoRA runs);
  a mode's lanes run twice in their own session and their own rerun noise joins the bound (vLLM's LoRA reruns at
  TP 4 were 13x noisier than at TP 2 on gpt-oss-20b, H200);
- rounding noise: max |Δ| of a lane whose adapter entries were each moved by up to one rounding of the run dtype
  (rerounded). Relations that change the arithmetic (M·A with B·M⁻¹, merged weights, a batch tiled differently)
  change it at that level, and a deterministic engine (rerun noise 0) would otherwise FAIL them on their rounding.
  On random-init full-width models it is large: routers have near-ties everywhere, so a last-bit change flips experts.

    ratio = max |Δ(lane, reference)| / max(rerun noise, rounding noise, FLOOR[dtype])   FAIL when ratio > FACTORS[dtype]
    16-bit runs, inexact lanes, also: k2 ratio = k2(lane, reference) / max(k2 of the rerun and rounding noise,
    K2_FLOOR[dtype])   FAIL when it is > K2_FACTORS[dtype] (see K2_FACTORS for why)

``exact`` lanes (a zero-B adapter against the base model) are bounded by the rerun noise alone: bit for bit when
reruns are. Each lane also reports k2 and the LoRA-delta difference ‖lane − ref‖₂ / ‖adapter − base‖₂
(= ‖Δ_lane − Δ_ref‖ / ‖Δ_ref‖ when both are adapter lanes). A relation that cannot apply (no expert LoRA, an engine
mode this engine or machine lacks, a layout the engine is known to drop or a rank it cannot hold — harness.doctor
says which) is reported ``n/a`` with the reason, never skipped silently.

Calibration, fp32 (benchmarks/results/metamorphic.csv: tiny zoo "all" adapters, CPU, hf on qwen3-moe /
gpt-oss / nemotron-h and triton on qwen3-moe / gpt-oss, every relation, 2 reruns): reruns were bit-identical
(noise 0) in every case, so the floor decides. FLOOR float32 = 1e-6 (fp32 rounding of a logprob of size ~10); the
worst clean lane was 8.58e-6 (ratio 8.6, hf merged weights on tiny-qwen3-moe), so FACTOR = 100 (10x above it,
rounded up). The faults in tests/harness/commands/test_metamorphic.py (an expert dropped on the per-expert load
path, gpt-oss interleaved gate/up read as concatenated by a converter) give ratios above 1e5.
bf16: FLOOR 1e-2 is one bf16 rounding of a logit of size ~2-5; the rounding-noise lane exists because SGLang (rerun
noise 0) moved by max |Δ| 1.7 on gpt-oss-20b for M·A / B·M⁻¹ (H200) — the size of HF's own bf16-vs-fp32 difference
there — against a 1e-2 floor. Calibration, bf16 (H200, 4-layer Qwen3-30B-A3B and
gpt-oss-20b, vLLM 0.25.1 and SGLang 0.5.15, 39 clean relation lanes): the worst ratio against the new bound was 1.3
(SGLang gpt-oss M·A / B·M⁻¹), then 1.21 (vLLM Qwen3 merged weights); FACTORS[bfloat16] = 10, ~8x above it.
k2, bf16 (the same engines and models, 65 clean inexact lanes): the worst k2 ratio was 1.3 (SGLang
gpt-oss and vLLM Qwen3 merged weights), vLLM's gpt-oss gate/up defect (mode mixed_moe_lora_format) 10.3;
K2_FACTORS[bfloat16] = 5, ~4x above the clean worst and 2x below the defect. Checked again (vLLM shapes and TP 2,
SGLang Qwen3 extra / shapes / TP 2): 59 more clean lanes, worst k2 ratio 1.29; the defect 10.9.
"""

from __future__ import annotations

import datetime
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lpdiff.harness.commands.metamorphic_sessions import _arrange, execute, rerun_name, sessions
from lpdiff.harness.commands.relations import ORIG, RELATIONS, Context, Lane
from lpdiff.harness.pipeline.provenance import git_commit
from lpdiff.harness.pipeline.report import append_csv, table
from lpdiff.harness.spec.adapters import ModelLayout, load_canonical
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.spec.transforms import rerounded
from lpdiff.harness.types import LogprobRun, ModelSpec

__all__ = [
    "CSV_COLUMNS",
    "FACTOR",
    "FACTORS",
    "FLOOR",
    "RELATIONS",
    "ROUNDING",
    "Context",
    "Lane",
    "Report",
    "Result",
    "_arrange",
    "csv_rows",
    "execute",
    "format_report",
    "judge_lanes",
    "plan",
    "rerun_name",
    "run_metamorphic",
    "sessions",
    "write_csv",
]

FLOOR = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 1e-2}
FACTOR = 100.0
FACTORS = {"float32": FACTOR, "bfloat16": 10.0, "float16": 10.0}
# the second test of an inexact lane in 16-bit runs: its k2 (mean of half squared differences, every position)
# against the largest k2 of the rerun and rounding noise. Routing flips make max |Δ| of random-init models large
# everywhere, so a systematic error that moves every position a little stays under the max bound; the mean sees it
# (vLLM 0.25.1's gate/up defect on gpt-oss-20b: max ratio 1.74, k2 ratio 10.3). fp32 runs have no such test:
# their max is taken before the first router near-tie and is sharp there, while their k2 over every position counts
# those flips (triton fp32 kernel modes reach k2 ratios of 1e5 with every position before a near-tie clean).
K2_FLOOR = {"bfloat16": 0.5 * FLOOR["bfloat16"] ** 2, "float16": 0.5 * FLOOR["float16"] ** 2}
K2_FACTORS = {"bfloat16": 5.0, "float16": 5.0}
# the relative error of one rounding to the run dtype: the size of the change a re-parametrised adapter (M·A,
# B·M⁻¹, merged weights) or another kernel tiling (a different batch) makes to the arithmetic
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
ROUNDING = "noise:rounding"
CSV_COLUMNS = (
    "date",
    "commit",
    "gpu",
    "engine",
    "engine_version",
    "model",
    "relation",
    "adapter",
    "max_abs",
    "k2",
    "delta_rel",
    "rerun_noise",
    "ratio",
    "verdict",
    "note",
)
# -- running -------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    relation: str
    verdict: str  # PASS | FAIL | n/a
    max_abs: float | None = None
    k2: float | None = None
    delta_rel: float | None = None
    rerun_noise: float | None = None
    ratio: float | None = None
    near_tie_share: float | None = None
    note: str = ""
    k2_ratio: float | None = None  # 16-bit inexact lanes: k2 / max(rerun k2, rounding k2, K2_FLOOR)


@dataclass(slots=True)
class Report:
    engine: str
    engine_version: str
    model: str
    adapter: str
    dtype: str
    k: int
    results: list[Result]
    gpu: str = "cpu"
    factor: float = FACTOR

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.verdict == "FAIL"]

    def get(self, relation: str) -> Result:
        return next(r for r in self.results if r.relation == relation)


def plan(ctx: Context, relations: Sequence[str] | None = None) -> tuple[list[Lane], list[Result]]:
    """Apply the transformations (writing adapter directories under ctx.tmp) -> lanes to run, n/a results."""
    names = list(RELATIONS) if relations is None else list(relations)
    unknown = [n for n in names if n not in RELATIONS]
    if unknown:
        raise InputError(f"unknown relation(s) {unknown}; known: {', '.join(RELATIONS)}")
    lanes, na = [], []
    for n in names:
        t0 = time.perf_counter()
        got = RELATIONS[n].lanes(ctx)
        ctx.log(f"plan {n}: {time.perf_counter() - t0:.1f} s")
        if isinstance(got, str):
            na.append(Result(n, "n/a", note=got))
            continue
        for x in got:
            if isinstance(x, Lane):
                lanes.append(x)
            else:
                rel, _, why = x.partition(": ")
                na.append(Result(rel, "n/a", note=why))
    return lanes, na


def _noise(reruns: list[LogprobRun], stat: str = "max_abs") -> float:
    from lpdiff.harness.pipeline.metrics import compare

    return max(getattr(compare(r, reruns[0]), stat) for r in reruns[1:])


def judge_lanes(
    lanes: list[Lane],
    runs: dict[str, LogprobRun],
    origs: list[LogprobRun],
    bases: list[LogprobRun],
    dtype: str,
    factor: float | None = None,
    floor: float | None = None,
    near_tie_eps: float | None = None,
) -> list[Result]:
    """``near_tie_eps``: judge max |Δ| on the positions before any router near-tie (random-init full-size models,
    where a last-bit difference flips an expert); the excluded share is in the note. None: every position.
    A lane named ROUNDING (the adapter re-rounded, see rerounded) is not judged: its difference from the original
    is the rounding noise, part of the bound of every inexact lane."""
    from lpdiff.harness.pipeline.metrics import NEAR_TIE_EPS, compare

    factor = FACTORS[dtype] if factor is None else factor
    floor = FLOOR[dtype] if floor is None else floor
    noise = max(_noise(origs), _noise(bases))
    k2_noise = max(_noise(origs, "k2"), _noise(bases, "k2"))
    flat = {n: np.concatenate([p.logprobs for p in r.prompts]).astype(np.float64) for n, r in runs.items()}
    flat[ORIG] = np.concatenate([p.logprobs for p in origs[0].prompts]).astype(np.float64)
    flat["base"] = np.concatenate([p.logprobs for p in bases[0].prompts]).astype(np.float64)
    refs = {ORIG: origs[0], "base": bases[0], **runs}
    base_rows = {"base"} | {x.name for x in lanes if x.adapter is None}

    def measure(lane: Lane):
        m = compare(
            runs[lane.name],
            refs[lane.reference],
            near_tie_eps=near_tie_eps if near_tie_eps is not None else NEAR_TIE_EPS[dtype],
        )
        judged = m.clean if near_tie_eps is not None and m.clean is not None else m
        # the size of the adapter effect the difference is measured in: the reference's own, or the original's
        effect_ref = (
            ORIG if lane.reference == ORIG or lane.reference in base_rows or lane.adapter is None else lane.reference
        )  # base rows against base rows of another session: the original's
        effect = float(np.linalg.norm(flat[effect_ref] - flat["base"]))
        delta_rel = float(np.linalg.norm(flat[lane.name] - flat[lane.reference])) / effect if effect else float("nan")
        note = "" if lane.reference == ORIG else f"vs {lane.reference}"
        if m.num_nonfinite:
            note = f"{m.num_nonfinite} NaN/inf logprobs; " + note
        if judged is not m:
            note += f"; ratio over positions before a router near-tie ({m.near_tie_share:.1%} excluded)"
        return m, judged, delta_rel, note.strip("; ")

    out, rounding, rounding_k2 = [], 0.0, 0.0
    for lane in (x for x in lanes if x.name == ROUNDING):
        m, judged, delta_rel, note = measure(lane)
        rounding, rounding_k2 = judged.max_abs, m.k2
        out.append(
            Result(
                lane.name,
                "noise",
                m.max_abs,
                m.k2,
                delta_rel,
                noise,
                None,
                m.near_tie_share,
                f"the adapter's entries moved by up to one {dtype} rounding: the floor of inexact relations"
                + (f"; {note}" if note else ""),
            )
        )
    for lane in lanes:
        if not lane.reference or lane.name == ROUNDING:
            continue
        m, judged, delta_rel, note = measure(lane)
        own_runs = [runs[rerun_name(lane.name, j)] for j in range(lane.reruns)]
        own = _noise(own_runs) if lane.reruns > 1 else 0.0
        lane_noise = max(noise, own)
        bound = lane_noise if lane.exact else max(lane_noise, rounding, floor)
        ratio = judged.max_abs / bound if bound else (0.0 if judged.max_abs == 0 else math.inf)
        bad = m.num_nonfinite or not ratio <= factor
        if not lane.exact or own > noise:
            which = (
                "this lane's rerun noise"
                if bound == own > noise
                else "rerun noise"
                if bound == noise
                else "rounding noise"
                if bound == rounding
                else f"the {dtype} floor"
            )
            note = (note + "; " if note else "") + f"bound: {which}"
        k2_ratio = None
        if dtype in K2_FACTORS and not lane.exact:
            own_k2 = _noise(own_runs, "k2") if lane.reruns > 1 else 0.0
            k2_ratio = m.k2 / max(k2_noise, own_k2, rounding_k2, K2_FLOOR[dtype])
            bad = bad or not k2_ratio <= K2_FACTORS[dtype]
            note += f"; k2 ratio {k2_ratio:.3g}" + (f" > {K2_FACTORS[dtype]:g}" if k2_ratio > K2_FACTORS[dtype] else "")
        out.append(
            Result(
                lane.name,
                "FAIL" if bad else "PASS",
                m.max_abs,
                m.k2,
                delta_rel,
                lane_noise,
                ratio,
                m.near_tie_share,
                note,
                k2_ratio,
            )
        )
    return out


def run_metamorphic(
    engine: str,
    spec: ModelSpec,
    adapter_dir: str | Path,
    prompts: list[list[int]],
    *,
    adapter_name: str | None = None,
    dtype: str = "float32",
    tp: int = 1,
    options: dict | None = None,
    relations: Sequence[str] | None = None,
    k: int = 2,
    factor: float | None = None,
    near_tie_eps: float | None = None,
    tmp: str | Path | None = None,
    log: Callable[[str], None] = lambda s: None,
    on_results: Callable[[str, list[Result]], None] | None = None,
    neighbours: dict[str, str] | None = None,
) -> Report:
    """Every relation (or those named) on one engine, model and adapter (see judge_lanes for near_tie_eps).
    ``on_results(engine_version, results)``: each engine session's verdicts as soon as it ends, then the n/a ones.
    ``neighbours``: more adapters (name -> directory) beside which the neutral relation runs base rows."""
    from lpdiff.harness.pipeline.provenance import device_name
    from lpdiff.harness.spec.catalog import hf_config

    own_tmp = tmp is None
    tmp = Path(tempfile.mkdtemp(prefix="lpdiff-metamorphic-") if tmp is None else tmp)
    try:
        t0 = time.perf_counter()
        hf = hf_config(spec)
        layout = ModelLayout.from_config(hf)
        ctx = Context(
            engine,
            spec,
            hf,
            layout,
            load_canonical(adapter_dir, layout),
            Path(adapter_dir),
            tmp,
            dtype,
            tp,
            dict(options or {}),
            log=log,
            neighbours=dict(neighbours or {}),
        )
        log(f"read the adapter: {time.perf_counter() - t0:.1f} s")
        lanes, na = plan(ctx, relations)
        rounding = (
            [
                Lane(
                    ROUNDING,
                    ctx.write("rerounded", rerounded(ctx.adapter, UNIT_ROUNDOFF[dtype], ctx.seed + 2)),
                    session="original",
                )
            ]
            if any(lane.reference and not lane.exact for lane in lanes)
            else []
        )
        factor = FACTORS[dtype] if factor is None else factor
        results: list[Result] = []
        names = {lane.name for lane in lanes}
        waiting: list[Lane] = []  # lanes whose reference lane has not run yet (sessions that reference each other)

        def judge_session(group, runs, origs, bases, version):
            # the rounding lane runs in the original's session, the first: every later session is judged with it
            first = not results
            ready = [x for x in [*waiting, *group] if x.name != ROUNDING]
            waiting[:] = [x for x in ready if x.reference in names and x.reference not in runs]
            ready = [x for x in ready if x not in waiting]
            got = judge_lanes([*rounding, *ready], runs, origs, bases, dtype, factor, near_tie_eps=near_tie_eps)
            got = [r for r in got if first or r.relation != ROUNDING]
            results.extend(got)
            if on_results is not None:
                on_results(version, got)

        version = execute(ctx, lanes + rounding, prompts, k, log, judge_session)[3]
        if waiting:  # every lane ran once execute returns: a reference still missing is lpdiff's own bug
            raise RuntimeError(f"lanes {[x.name for x in waiting]} reference lanes that never ran")
        if on_results is not None and na:
            on_results(version, na)
        results += na
        order = {n: i for i, n in enumerate(RELATIONS)} | {"noise": -1, "mode": list(RELATIONS).index("modes")}
        results.sort(key=lambda r: (order.get(r.relation.split(":")[0], 99), r.relation))
        return Report(
            engine, version, spec.name, adapter_name or Path(adapter_dir).name, dtype, k, results, device_name(), factor
        )
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


# -- output --------------------------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def _numbers(r: Result) -> tuple[str, ...]:
    """max |Δ|, k2, Δ rel, rerun noise and ratio as the table and the CSV print them."""
    return tuple(_fmt(x) for x in (r.max_abs, r.k2, r.delta_rel, r.rerun_noise, r.ratio))


def format_report(rep: Report) -> str:
    title = (
        f"{rep.model} / {rep.adapter} on {rep.engine} ({rep.engine_version}), {rep.dtype}, {rep.k} reruns; "
        f"FAIL when ratio > {rep.factor:g}"
    )
    rows = [(r.relation, *_numbers(r), r.verdict, r.note) for r in rep.results]
    return title + "\n" + table(rows, ("relation", "max |Δ|", "k2", "Δ rel", "rerun noise", "ratio", "verdict", "note"))


def csv_rows(rep: Report) -> list[dict]:
    date, commit = datetime.date.today().isoformat(), git_commit()
    return [
        dict(
            zip(
                CSV_COLUMNS,
                (
                    date,
                    commit,
                    rep.gpu,
                    rep.engine,
                    rep.engine_version,
                    rep.model,
                    r.relation,
                    rep.adapter,
                    *_numbers(r),
                    r.verdict,
                    r.note,
                ),
            )
        )
        for r in rep.results
    ]


def write_csv(rep: Report, path: str | Path) -> Path:
    return append_csv(path, CSV_COLUMNS, csv_rows(rep))
