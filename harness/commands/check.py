"""``lpdiff check``: a serving engine (vllm, sglang, or our triton runtime) judged against an fp32 reference on a
full-width, reduced-depth model built from a catalog config, with thresholds from noise measured in the same run.

    lpdiff check --engine vllm --model qwen3-30b-a3b --layers 4 [--tp 2] [--csv benchmarks/results/engines_gpu.csv]

Why not the stored-baseline path (``lpdiff run``): vLLM and SGLang have no fp32 LoRA, and on random-init full-size
MoE models bf16 rounding flips near-tied routers, so a bf16 engine differs from fp32 by an amount that depends on
the model (k2 1e-4 on Qwen3-30B-A3B, 0.04 on gpt-oss-20b, H200). No fixed threshold fits both; the noise has
to be measured on the same model and prompts. Per (model, engine, dtype, TP):

  reference noise  two correct runs of the reference engine (``noise_pair``): in bf16, the reference in bf16
                   against its fp32 run (what bf16 rounding alone does, routing flips included); in fp32, two
                   correct expert kernels (HF batched_mm vs eager; triton kernels vs torch) — over the base lane
                   and every correct adapter lane;
  rerun noise      the engine under test against its own first run, ``k`` reruns of the whole mixed batch (vLLM's
                   LoRA runs are not bit-reproducible);
  threshold        FACTOR[dtype] x max(reference noise, rerun noise), for k2, max |Δ| and LoRA-delta fidelity.

A correct bf16 engine sits near 1x the reference noise (vLLM k2 1.4e-4 vs HF bf16 1.3e-4 on Qwen3-30B-A3B). Every lane
is judged over all positions (the noise was measured over all of them too); the share after a router near-tie in
the fp32 reference is reported beside it.

Adapters, generated with fixed seeds (``ADAPTERS``): rank 16 on attention + experts, attention only and experts only
(LoRA-delta fidelity per module group), rank 8 beside the rank-16 ones (a loaded rank below the engine's max rank),
and ``broken``: the rank-16 adapter with every expert's LoRA-B shifted to the next expert (an expert-ordering bug
in a loader), which the engine serves while the reference gets the correct adapter — it must FAIL. Each adapter is
served to the engine in every layout that engine reads (its capabilities), under the decoder root it maps names from
(vLLM on Qwen3.5: ``model.language_model``), all in one batch with base rows; the reference always reads PEFT's own
3D format under the text model's names.

Reference runs go through the baseline store (policy ``cache``: computed once, then answered from the store), so
checks of several engines on one machine compute them once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lpdiff.engines import DEFAULT_ENGINE, REFERENCE_ENGINE
from lpdiff.engines.base import layouts_for
from lpdiff.harness.commands.check_case import (
    ADAPTERS,
    HYBRID_ADAPTERS,
    PROMPT_LENGTHS,
    AdapterPlan,
    Case,
    build_case,
    case_layers,
    make_prompts,
    plans_for,
    served_files,
    trainer_plans_for,
)
from lpdiff.harness.commands.check_output import CSV_COLUMNS, csv_rows, format_result, write_csv
from lpdiff.harness.pipeline.metrics import compare, delta_fidelity, near_tie_eps, position_detail
from lpdiff.harness.pipeline.noise import (
    REFERENCE_DTYPE,
    Noise,
    fp32_rounding_floor,
    noise_pair,
    pair_noise,
    rerun_noise,
    threshold_from,
)
from lpdiff.harness.pipeline.references import References
from lpdiff.harness.pipeline.session import Lanes, engine_options, run_session
from lpdiff.harness.pipeline.store import BaselineStore
from lpdiff.harness.pipeline.thresholds import Threshold
from lpdiff.harness.pipeline.verdict import judge
from lpdiff.harness.types import AdapterSpec

# the case (check_case.py) and the output (check_output.py) are read through here too
__all__ = [
    "ADAPTERS",
    "CSV_COLUMNS",
    "FACTOR",
    "HYBRID_ADAPTERS",
    "PROMPT_LENGTHS",
    "AdapterPlan",
    "Case",
    "CheckRequest",
    "CheckResult",
    "build_case",
    "case_layers",
    "check_result",
    "csv_rows",
    "engine_pair",
    "fault_sweep",
    "format_result",
    "make_prompts",
    "missed",
    "plans_for",
    "reference_runs",
    "refused_lanes",
    "run_check",
    "served_files",
    "served_lanes",
    "trainer_plans_for",
    "write_csv",
]

# bf16: a correct engine sits near 1x (see above); fp32: the tiny zoo's calibrated factor (harness/calibrate.py)
FACTOR = {"bfloat16": 3.0, "float32": 30.0}


# -- runs ---------------------------------------------------------------------------------------------------------


def reference_runs(
    case: Case,
    reference: str,
    dtype: str,
    options: dict | None,
    store: BaselineStore,
    log: Callable[[str], None] = print,
) -> Lanes:
    """The reference engine's runs (base + every correct adapter, PEFT 3D files), from the store or computed and
    kept there (reference runs of several engines' checks on one machine are computed once)."""
    adapters = {n: AdapterSpec(n, case.files[(n, "peft3d")].path) for n, p in case.plans.items() if not p.broken_from}
    refs = References(store, reference, dtype, options or None, 0, "cache", log=lambda m: log(f"[check] {m}"))
    return refs.runs(case.spec, adapters, case.prompts)


@dataclass(slots=True)
class CheckResult:
    model: str
    layers: int
    engine: str
    reference: str
    tp: int
    dtype: str
    engine_version: str
    ref_noise: Noise
    rerun_noise: Noise
    threshold: Threshold | None  # None when the engine failed (error)
    runs: list[dict]  # the engine's runs, each {lane (None = base): LogprobRun}
    verdicts: list = field(default_factory=list)  # harness.verdict.Verdict, with .adapter "name.layout"
    error: str | None = None  # the engine died or raised: every lane FAILs with this message
    refused: dict[str, str] = field(default_factory=dict)  # lane -> doctor's error for this engine (not served)
    init_recipe: str = ""  # the model's weights (catalog init recipe; "" for a checkpoint)
    engine_pair: str = ""  # engine_pair(): what was judged against what

    @property
    def as_expected(self) -> bool:
        return self.error is None and all(("PASS" if v.passed else "FAIL") == v.expected for v in self.verdicts)


# where an engine runs (its interpreter, its lane), not how it computes
_WHERE_OPTIONS = ("python", "lane", "lane_env")


def engine_pair(engine: str, dtype: str, reference: str, options: dict) -> str:
    """'vllm:bfloat16-vs-hf:float32'. An engine judged against itself names the options it ran with
    ('hf[experts_impl=eager]:float32-vs-hf:float32', HF's eager experts against HF's default kernel), so the row is
    not read as a self-comparison."""
    how = ",".join(f"{k}={v}" for k, v in sorted(options.items()) if k not in _WHERE_OPTIONS)
    tag = f"[{how}]" if how and engine == reference else ""
    return f"{engine}{tag}:{dtype}-vs-{reference}:{REFERENCE_DTYPE}"


@dataclass(frozen=True, slots=True)
class CheckRequest:
    """One engine judged on one case: what run_check and replay_check take. ``layouts``: the adapter files served
    (default: every layout the engine reads); the lanes doctor says the engine refuses are left out unless
    ``serve_refused`` (a known defect reproduced on purpose). ``options`` merge over the engine's defaults."""

    case: Case
    engine: str
    tp: int = 1
    reference: str = REFERENCE_ENGINE
    k: int = 3  # runs of the engine: its rerun noise needs two at least
    options: dict | None = None
    dtype: str = "bfloat16"
    layouts: Sequence[str] | None = None
    serve_refused: bool = False

    def __post_init__(self) -> None:
        assert self.k >= 2, "rerun noise needs k >= 2 runs"


def run_check(req: CheckRequest, log: Callable[[str], None] = print, store: BaselineStore | None = None) -> CheckResult:
    """The engine in ``req.dtype`` against the reference in fp32, judged with FACTOR[dtype] x the noise measured
    here; the lanes doctor refuses are reported in ``refused_lanes``. An engine that dies or raises gives a result
    whose ``error`` holds its message (for a subprocess lane, its last log lines)."""
    from lpdiff.harness.pipeline.references import default_store

    case, engine, tp, reference, k, dtype = req.case, req.engine, req.tp, req.reference, req.k, req.dtype
    store = store if store is not None else default_store()
    refs: dict[tuple[str, str], Lanes] = {}

    def ref(d: str, o: dict) -> Lanes:  # each reference run once, whatever asks for it
        key = (d, repr(sorted(o.items())))
        if key not in refs:
            refs[key] = reference_runs(case, reference, d, o, store, log)
        return refs[key]

    ref32 = ref(REFERENCE_DTYPE, {})
    (da, oa), (db, ob) = noise_pair(reference, dtype)
    ref_noise = pair_noise(ref(da, oa), ref(db, ob), list(ref32))

    lanes, refused = served_lanes(req)
    log(f"[check] {engine} tp={tp}: starting, {len(lanes)} lanes ({len(refused)} refused)")
    t_start = time.perf_counter()
    opts = {**engine_options(engine), **(req.options or {})}
    pair = engine_pair(engine, dtype, reference, opts)
    try:
        sess = run_session(engine, case.spec, lanes, case.prompts, dtype, tp, options=opts, reruns=k)
    except Exception as e:  # noqa: BLE001 - a dead or refusing engine is a verdict, not a crashed session
        log(f"[check] {engine} tp={tp} failed: {type(e).__name__}")
        return check_result(req, pair, refused, ref_noise, error=e)
    log(
        f"[check] {engine} tp={tp}: {k} runs of {len(lanes) + 1} lanes x {len(case.prompts)} prompts in "
        f"{sess.wall_s:.1f}s, {time.perf_counter() - t_start:.1f}s with start and close ({sess.version})"
    )
    reruns = rerun_noise(sess.runs)
    noise = Noise().merge(ref_noise, reruns)
    # fp32: two correct engines differ by rounding even where the reference's two kernels agree exactly
    floor = fp32_rounding_floor(ref32, case_layers(case)) if dtype == REFERENCE_DTYPE else None
    t = threshold_from(
        noise,
        FACTOR[dtype],
        note=f"noise = max of {reference} {da}{oa or ''}-vs-{db}{ob or ''} "
        f"({ref_noise.describe()}) and {engine} rerun noise over {k} runs ({reruns.describe()}), "
        f"same model and prompts",
        floor=floor,
    )
    t.model, t.engine_pair, t.dtype, t.tp = case.spec.name, pair, dtype, tp
    res = check_result(req, pair, refused, ref_noise, sess, reruns, t)
    eps = near_tie_eps(dtype, REFERENCE_DTYPE)
    got = sess.first
    for lane in [None, *lanes]:
        name = None if lane is None else lane.split(".")[0]
        ref_run = ref32[None if name is None else case.plans[name].broken_from or name]
        m = compare(got[lane], ref_run, near_tie_eps=eps)
        fid = None if lane is None else delta_fidelity(got[lane], got[None], ref_run, ref32[None])
        v = judge(m, t, fid, adapter=lane or "base")
        v.expected = case.plans[name].expected if name else "PASS"
        v.detail = position_detail(got[lane], ref_run, eps)
        res.verdicts.append(v)
    return res


def served_lanes(req: CheckRequest) -> tuple[dict[str, AdapterSpec], dict[str, str]]:
    """-> (the lanes served to the engine: the case's files in ``req.layouts``, default every layout it reads, less
    those doctor refuses unless ``req.serve_refused``; the refused lanes with doctor's message)."""
    case, engine = req.case, req.engine
    lanes = served_files(case, engine, req.layouts or layouts_for(engine, case.spec.arch))
    refused = {} if req.serve_refused else refused_lanes(case, engine, lanes)
    return {lane: a for lane, a in lanes.items() if lane not in refused}, refused


def check_result(
    req: CheckRequest,
    pair: str,
    refused: dict[str, str],
    ref_noise: Noise,
    sess=None,
    reruns: Noise | None = None,
    threshold: Threshold | None = None,
    error: Exception | None = None,
) -> CheckResult:
    """A check's result before its verdicts: of the engine session ``sess`` (its runs, version, rerun noise and the
    threshold from it), or of an engine that died or raised (``error``: every lane FAILs with its message)."""
    spec = req.case.spec
    return CheckResult(
        spec.name,
        spec.num_layers or 0,
        req.engine,
        req.reference,
        req.tp,
        req.dtype,
        "?" if sess is None else sess.version,
        ref_noise,
        reruns or Noise(),
        threshold,
        [] if sess is None else sess.runs,
        error=None if error is None else f"{type(error).__name__}: {error}",
        refused=refused,
        init_recipe=spec.init_recipe or "",
        engine_pair=pair,
    )


def refused_lanes(case: Case, engine: str, lanes: dict[str, AdapterSpec], verdict: str = "prefill") -> dict[str, str]:
    """Lanes whose adapter ``lpdiff doctor`` says this engine refuses or computes wrongly (an error finding) in a
    ``verdict`` ("prefill", or "decode": check_case_decode): not served, reported with the doctor's message (e.g.
    SGLang has no LoRA for Qwen3.5's GDN projections)."""
    from lpdiff.harness.pipeline.doctor import refusals

    out = {}
    for lane, a in lanes.items():
        if errors := refusals(case.spec, a.path, engine, verdict).errors:
            out[lane] = f"{errors[0].code}: {errors[0].message}"
    return out


def fault_sweep(
    case: Case,
    faults: Sequence[str],
    dtype: str = "float32",
    k: int = 2,
    store=None,
    log: Callable[[str], None] = print,
) -> tuple[CheckResult, dict[str, CheckResult | None]]:
    """lpdiff's own runtime (DEFAULT_ENGINE) clean and with each bug-zoo fault (kernels/faults.py), judged like any
    engine. A fault whose runs are bit-identical to clean runs on the same code path is not reached at this shape
    (e.g. an unmasked tile on a width that is a multiple of the block) and maps to None. The faults inside the
    grouped GEMM (KERNEL_FAULTS) force its K-loop shrink (moe_lora_shrink "fused"), which rounds differently from the
    default "once": they are compared with a clean "fused" run, else an unreached fault would look reached and
    missed."""
    import numpy as np

    from lpdiff.kernels.fused_moe_lora import KERNEL_FAULTS

    def check(k: int, options: dict | None = None) -> CheckResult:
        return run_check(CheckRequest(case, DEFAULT_ENGINE, k=k, options=options, dtype=dtype), log, store)

    clean = check(k)
    clean_fused = None
    out: dict[str, CheckResult | None] = {}
    for fault in faults:
        ref = clean
        if any(fault in by_gemm for by_gemm in KERNEL_FAULTS.values()):
            if clean_fused is None:
                clean_fused = check(2, {"moe_lora_shrink": "fused"})
            ref = clean_fused
        res = check(2, {"fault": fault})
        same = all(
            np.array_equal(p.logprobs, q.logprobs)
            for lane in res.runs[0]
            for p, q in zip(res.runs[0][lane].prompts, ref.runs[0][lane].prompts)
        )
        out[fault] = None if same else res
    return clean, out


def missed(res: CheckResult) -> bool:
    """True when every lane that should PASS passed: the run shows no sign of a fault."""
    return all(v.passed for v in res.verdicts if v.expected == "PASS")
