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

A correct bf16 engine sits near 1x the reference noise (vLLM k2 1.4e-4 vs HF bf16 1.3e-4 on Qwen3-30B-A3B). Every lane is
judged over all positions (the noise was measured over all of them too); the share after a router near-tie in
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

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lpdiff.engines import DEFAULT_ENGINE, REFERENCE_ENGINE
from lpdiff.engines.base import ENGINES, capabilities, layouts_for
from lpdiff.engines.capabilities import model_type
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
from lpdiff.harness.pipeline.provenance import device_name, git_commit
from lpdiff.harness.pipeline.references import References
from lpdiff.harness.pipeline.report import append_csv, verdict_table
from lpdiff.harness.pipeline.session import Lanes, engine_options, run_session
from lpdiff.harness.pipeline.store import BaselineStore
from lpdiff.harness.pipeline.verdict import judge
from lpdiff.harness.types import AdapterSpec, ModelSpec

# bf16: a correct engine sits near 1x (see above); fp32: the tiny zoo's calibrated factor (harness/calibrate.py)
FACTOR = {"bfloat16": 3.0, "float32": 30.0}


PROMPT_LENGTHS = (256, 131, 200, 64, 256, 97, 180, 33)
CSV_COLUMNS = (
    "date",
    "commit",
    "gpu",
    "engine_version",
    "model",
    "layers",
    "tp",
    "dtype",
    "adapter",
    "adapter_format",
    "engine_pair",
    "k2",
    "max_abs",
    "mean_abs",
    "delta_fidelity",
    "near_tie_share",
    "threshold_k2",
    "threshold_max",
    "threshold_fidelity",
    "ref_noise_k2",
    "ref_noise_max",
    "ref_noise_fidelity",
    "rerun_noise_k2",
    "rerun_noise_max",
    "rerun_noise_fidelity",
    "expected",
    "verdict",
    "reasons",
    "init_recipe",
)


@dataclass(slots=True, frozen=True)
class AdapterPlan:
    name: str
    groups: tuple[str, ...]
    rank: int
    seed: int
    broken_from: str | None = None  # the correct adapter this one is a broken copy of (the reference runs that)
    # trainers' forms (generate_adapter's): rsLoRA, PEFT rank_pattern / alpha_pattern as (key, value) pairs
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @property
    def expected(self) -> str:
        return "FAIL" if self.broken_from else "PASS"


ADAPTERS = (
    AdapterPlan("all", ("attention", "experts"), 16, 1),
    AdapterPlan("attention", ("attention",), 16, 2),
    AdapterPlan("experts", ("experts",), 16, 3),
    AdapterPlan("all_r8", ("attention", "experts"), 8, 4),  # below the max rank (16) the engine is started with
    AdapterPlan("broken", ("attention", "experts"), 16, 1, broken_from="all"),
)


# the hybrids: one adapter per module group of theirs beside the groups every engine serves, so that a dropped
# group is named by its own lane; "all" holds the groups vLLM and SGLang both read (SGLang has no LoRA for HF's
# GDN projections nor a PEFT-shaped mamba in_proj: those lanes are served where the engine reads them)
_HYBRID_COMMON = ("attention", "shared_expert", "experts")
HYBRID_ADAPTERS = {
    arch: (
        AdapterPlan("all", _HYBRID_COMMON, 16, 1),
        AdapterPlan("all_groups", (*_HYBRID_COMMON, own), 16, 8),  # every group together, where the engine reads them
        AdapterPlan(own, (own,), 16, 2),
        AdapterPlan("attention", ("attention",), 16, 5),
        AdapterPlan("shared_expert", ("shared_expert",), 16, 6),
        AdapterPlan("experts", ("experts",), 16, 3),
        AdapterPlan("all_r8", _HYBRID_COMMON, 8, 4),
        AdapterPlan("broken", _HYBRID_COMMON, 16, 1, broken_from="all"),
        AdapterPlan(
            "latent", ("latent",), 16, 7
        ),  # Nemotron-3-Super's latent MoE projections (where the model has them)
    )
    for arch, own in (("qwen3_5_moe", "linear_attention"), ("nemotron_h", "mamba"))
}


def plans_for(arch: str) -> tuple[AdapterPlan, ...]:
    return HYBRID_ADAPTERS.get(model_type(arch), ADAPTERS)


def trainer_plans_for(arch: str) -> tuple[AdapterPlan, ...]:
    """The adapters trainers write (issue 42), beside the arch's "all" and "broken" lanes: rsLoRA with rank/alpha
    patterns (keys that name a module suffix on every arch), lm_head + embed_tokens alone and with the decoder
    groups, rank 128 (vLLM 0.25.1's MoE-LoRA limit) and 256 (above it: doctor refuses it for vLLM, moe-rank-above-
    128). Each engine is served the lanes doctor does not refuse for it."""
    base = plans_for(arch)
    decoder = next(p.groups for p in base if p.name == "all")
    return (
        *(p for p in base if p.name in ("all", "broken")),
        AdapterPlan(
            "rslora_patterns",
            decoder,
            16,
            11,
            use_rslora=True,
            rank_pattern=(("q_proj", 8), ("experts.down_proj", 4)),
            alpha_pattern=(("o_proj", 6.0), ("experts.down_proj", 40.0)),
        ),
        AdapterPlan("vocab", ("lm_head", "embed_tokens"), 16, 12),
        AdapterPlan("all_vocab", (*decoder, "lm_head", "embed_tokens"), 16, 13, use_rslora=True),
        AdapterPlan("rank128", decoder, 128, 14),
        AdapterPlan("rank256", decoder, 256, 15),
    )


def make_prompts(vocab_size: int, lengths: Sequence[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@dataclass(slots=True)
class Case:
    """One model with its adapters (PEFT 3D for the reference, every engine layout) and prompts."""

    spec: ModelSpec
    plans: dict[str, AdapterPlan]
    files: dict[tuple[str, str], AdapterSpec]  # (adapter, layout) -> directory
    prompts: list[list[int]]


def build_case(
    model: str,
    layers: int,
    root: str | Path,
    plans: Sequence[AdapterPlan] | None = None,
    layouts: Sequence[str] | None = None,
    device: str = "cuda",
    lengths: Sequence[int] = PROMPT_LENGTHS,
    log: Callable[[str], None] = print,
    init_recipe: str | None = None,
) -> Case:
    """``plans``: default ``plans_for`` the model; ``layouts``: default every layout an engine reads on it;
    ``init_recipe``: a config-built model's weights (catalog.INIT_RECIPES; default: catalog's choice)."""
    import torch

    from lpdiff.harness.spec.adapters import LAYOUTS, ModelLayout, convert_adapter, generate_adapter, module_group
    from lpdiff.harness.spec.catalog import get_model, hf_config, load_hf_model
    from lpdiff.harness.spec.mutations import permute_experts

    spec = get_model(model, num_layers=layers, init_recipe=init_recipe)
    if layouts is None:
        layouts = [lay for lay in LAYOUTS if any(lay in layouts_for(e, spec.arch) for e in ENGINES)]
    root = Path(root)
    t0 = time.perf_counter()
    hf = load_hf_model(spec, torch.bfloat16, device)  # only its weights' RMS sizes the adapters
    log(f"[check] {model} x{layers} layers ({spec.init_recipe}): model built in {time.perf_counter() - t0:.1f}s")
    if plans is None:  # the model's plans whose groups it has (a latent lane only where there are latent layers)
        lay = ModelLayout.of(hf)
        present = {module_group(n) for n in [*lay.linears, *lay.experts]}
        plans = [p for p in plans_for(spec.arch) if set(p.groups) <= present]
    cfg = hf_config(spec)
    files: dict[tuple[str, str], AdapterSpec] = {}
    for p in plans:
        d3 = root / f"{p.name}.peft3d"
        if p.broken_from:
            permute_experts(files[(p.broken_from, "peft3d")].path, d3)
            files[(p.name, "peft3d")] = AdapterSpec(d3.name, str(d3))
        else:
            files[(p.name, "peft3d")] = generate_adapter(
                hf,
                d3,
                groups=p.groups,
                rank=p.rank,
                alpha=2 * p.rank,
                seed=p.seed,
                use_rslora=p.use_rslora,
                rank_pattern=dict(p.rank_pattern),
                alpha_pattern=dict(p.alpha_pattern),
            )
        for layout in layouts:
            if layout != "peft3d":
                dst = root / f"{p.name}.{layout}"
                files[(p.name, layout)] = convert_adapter(d3, dst, layout, cfg)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"[check] {model} x{layers} layers: {len(files)} adapter files in {time.perf_counter() - t0:.1f}s")
    return Case(spec, {p.name: p for p in plans}, files, make_prompts(cfg.vocab_size, lengths))


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
    threshold: object
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


def run_check(
    case: Case,
    engine: str,
    tp: int = 1,
    reference: str = REFERENCE_ENGINE,
    k: int = 3,
    options: dict | None = None,
    store: BaselineStore | None = None,
    dtype: str = "bfloat16",
    layouts: Sequence[str] | None = None,
    serve_refused: bool = False,
    log: Callable[[str], None] = print,
) -> CheckResult:
    """The engine in ``dtype`` against the reference in fp32, judged with FACTOR[dtype] x the noise measured here.
    ``layouts``: the adapter files served (default: every layout the engine reads); the lanes doctor says the
    engine refuses are left out (``refused_lanes``) unless ``serve_refused`` (a known defect reproduced on purpose).
    An engine that dies or raises
    gives a result whose ``error`` holds its message (for a subprocess lane, its last log lines)."""
    from lpdiff.harness.pipeline.references import default_store

    assert k >= 2, "rerun noise needs k >= 2 runs"
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

    lanes = served_files(case, engine, layouts or layouts_for(engine, case.spec.arch))
    refused = {} if serve_refused else refused_lanes(case, engine, lanes)
    lanes = {lane: a for lane, a in lanes.items() if lane not in refused}
    log(f"[check] {engine} tp={tp}: starting, {len(lanes)} lanes ({len(refused)} refused)")
    t_start = time.perf_counter()
    opts = {**engine_options(engine), **(options or {})}
    pair = engine_pair(engine, dtype, reference, opts)
    try:
        sess = run_session(engine, case.spec, lanes, case.prompts, dtype, tp, options=opts, reruns=k)
    except Exception as e:  # noqa: BLE001 - a dead or refusing engine is a verdict, not a crashed session
        log(f"[check] {engine} tp={tp} failed: {type(e).__name__}")
        return CheckResult(
            case.spec.name,
            case.spec.num_layers or 0,
            engine,
            reference,
            tp,
            dtype,
            "?",
            ref_noise,
            Noise(),
            None,
            [],
            error=f"{type(e).__name__}: {e}",
            refused=refused,
            init_recipe=case.spec.init_recipe or "",
            engine_pair=pair,
        )
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
    res = CheckResult(
        case.spec.name,
        case.spec.num_layers or 0,
        engine,
        reference,
        tp,
        dtype,
        sess.version,
        ref_noise,
        reruns,
        t,
        sess.runs,
        refused=refused,
        init_recipe=case.spec.init_recipe or "",
        engine_pair=pair,
    )
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


def case_layers(case: Case) -> int:
    """The decoder layers the case's model runs (its cut, else the config's depth)."""
    if case.spec.num_layers:
        return case.spec.num_layers
    from lpdiff.harness.spec.catalog import hf_config

    return int(getattr(hf_config(case.spec), "num_hidden_layers", 1) or 1)


def served_files(case: Case, engine: str, layouts: Sequence[str]) -> dict[str, AdapterSpec]:
    """The lanes (``name.layout`` -> directory) served to ``engine``: the case's files in ``layouts``, or, where the
    engine maps adapter names from its checkpoint's decoder root (``adapter_root``: vLLM on Qwen3.5's wrapper),
    copies written under that root, once per case (``<case dir>/<engine>-root/``) so every TP size reuses them. The
    reference keeps the text model's names, which transformers builds."""
    from lpdiff.harness.spec.adapters import ModelLayout
    from lpdiff.harness.spec.catalog import hf_config

    root = capabilities(engine).adapter_root(case.spec.arch)
    mlayout, lanes = None, {}
    for (name, layout), a in case.files.items():
        if layout not in layouts:
            continue
        path = Path(a.path)
        if root is not None:
            dst = path.parent / f"{engine}-root" / path.name
            if not dst.is_dir():  # renamed into place whole (_rerooted)
                if mlayout is None:
                    mlayout = ModelLayout.from_config(hf_config(case.spec))
                _rerooted(path, dst, layout, mlayout, root)
            path = dst
        lanes[f"{name}.{layout}"] = AdapterSpec(f"{name}.{layout}", str(path))
    return lanes


def _rerooted(src: Path, dst: Path, layout: str, mlayout, root: str) -> None:
    """``src`` written under decoder root ``root`` into a private directory renamed to ``dst``: processes sharing a
    case dir never see half a copy."""
    import os
    import shutil

    from lpdiff.harness.spec.adapters import convert_adapter

    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_adapter(src, tmp, layout, mlayout, disk_root=root)
    try:
        tmp.rename(dst)
    except OSError:  # another process wrote it meanwhile: the same content
        shutil.rmtree(tmp, ignore_errors=True)


def refused_lanes(case: Case, engine: str, lanes: dict[str, AdapterSpec]) -> dict[str, str]:
    """Lanes whose adapter ``lpdiff doctor`` says this engine refuses or computes wrongly (an error finding): not
    served, reported with the doctor's message (e.g. SGLang has no LoRA for Qwen3.5's GDN projections)."""
    from lpdiff.harness.pipeline.doctor import refusals

    out = {}
    for lane, a in lanes.items():
        if errors := refusals(case.spec, a.path, engine).errors:
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
    """lpdiff's own runtime (DEFAULT_ENGINE) clean and with each bug-zoo fault (kernels/faults.py), judged like any engine. A fault
    whose runs are bit-identical to clean runs on the same code path is not reached at this shape (e.g. an unmasked
    tile on a width that is a multiple of the block) and maps to None. The faults inside the grouped GEMM
    (KERNEL_FAULTS) force its K-loop shrink (moe_lora_shrink "fused"), which rounds differently from the default
    "once": they are compared with a clean "fused" run, else an unreached fault would look reached and missed."""
    import numpy as np

    from lpdiff.kernels.fused_moe_lora import KERNEL_FAULTS

    clean = run_check(case, DEFAULT_ENGINE, k=k, store=store, dtype=dtype, log=log)
    clean_fused = None
    out: dict[str, CheckResult | None] = {}
    for fault in faults:
        ref = clean
        if any(fault in by_gemm for by_gemm in KERNEL_FAULTS.values()):
            if clean_fused is None:
                clean_fused = run_check(
                    case, DEFAULT_ENGINE, k=2, options={"moe_lora_shrink": "fused"}, store=store, dtype=dtype, log=log
                )
            ref = clean_fused
        res = run_check(case, DEFAULT_ENGINE, k=2, options={"fault": fault}, store=store, dtype=dtype, log=log)
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


def format_result(res: CheckResult) -> str:
    if res.error is not None:
        return "\n".join(
            [
                (
                    f"{res.engine} {res.dtype} (tp={res.tp}) on {res.model} x{res.layers} layers: FAIL, the "
                    f"engine failed before giving logprobs:\n{res.error}"
                ),
                *_refused_lines(res),
            ]
        )
    ok = "as expected" if res.as_expected else "NOT AS EXPECTED"
    head = (
        f"{res.engine} {res.dtype} (tp={res.tp}, {res.engine_version}) vs {res.reference} fp32 on {res.model} "
        f"x{res.layers} layers: {ok}\nthreshold = {res.threshold.margin_factor:g} x noise: k2 "
        f"{res.threshold.k2:.3g}, max |Δ| "
        f"{res.threshold.max_abs:.3g}, fidelity {res.threshold.delta_fidelity:.3g} ({res.threshold.note})"
    )
    bad = [
        f"  {v.adapter}: expected {v.expected}" for v in res.verdicts if ("PASS" if v.passed else "FAIL") != v.expected
    ]
    return "\n".join([head, verdict_table(res.verdicts), *bad, *_refused_lines(res)])


def _refused_lines(res: CheckResult) -> list[str]:
    return [f"  {lane}: not served ({why})" for lane, why in res.refused.items()]


def csv_rows(res: CheckResult) -> list[dict]:
    return [{**row, "init_recipe": res.init_recipe} for row in _rows(res)]


def _rows(res: CheckResult) -> list[dict]:
    date, commit, gpu = datetime.date.today().isoformat(), git_commit(), device_name()
    if res.error is not None:
        lines = res.error.strip().splitlines()
        last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])[:300]  # the cause, not the teardown
        return [
            {
                "date": date,
                "commit": commit,
                "gpu": gpu,
                "model": res.model,
                "layers": res.layers,
                "tp": res.tp,
                "dtype": res.dtype,
                "engine_pair": res.engine_pair,
                "verdict": "FAIL",
                "reasons": f"engine failed: {last}",
            }
        ]
    t = res.threshold
    rows = [
        {
            "date": date,
            "commit": commit,
            "gpu": gpu,
            "engine_version": res.engine_version,
            "model": res.model,
            "layers": res.layers,
            "tp": res.tp,
            "dtype": res.dtype,
            "adapter": lane.partition(".")[0],
            "adapter_format": lane.partition(".")[2],
            "engine_pair": t.engine_pair,
            "verdict": "SKIP",
            "reasons": f"not served: {why}"[:300],
        }
        for lane, why in res.refused.items()
    ]
    for v in res.verdicts:
        name, _, layout = v.adapter.partition(".")
        m = v.metrics
        fid = "" if v.delta_fidelity is None else f"{v.delta_fidelity:.4g}"
        rows.append(
            {
                "date": date,
                "commit": commit,
                "gpu": gpu,
                "engine_version": res.engine_version,
                "model": res.model,
                "layers": res.layers,
                "tp": res.tp,
                "dtype": res.dtype,
                "adapter": name,
                "adapter_format": layout or "-",
                "engine_pair": t.engine_pair,
                "k2": f"{m.k2:.4g}",
                "max_abs": f"{m.max_abs:.4g}",
                "mean_abs": f"{m.mean_abs:.4g}",
                "delta_fidelity": fid,
                "near_tie_share": "" if m.near_tie_share is None else f"{m.near_tie_share:.3f}",
                "threshold_k2": f"{t.k2:.4g}",
                "threshold_max": f"{t.max_abs:.4g}",
                "threshold_fidelity": f"{t.delta_fidelity:.4g}",
                "ref_noise_k2": f"{res.ref_noise.k2:.4g}",
                "ref_noise_max": f"{res.ref_noise.max_abs:.4g}",
                "ref_noise_fidelity": f"{res.ref_noise.fidelity:.4g}",
                "rerun_noise_k2": f"{res.rerun_noise.k2:.4g}",
                "rerun_noise_max": f"{res.rerun_noise.max_abs:.4g}",
                "rerun_noise_fidelity": f"{res.rerun_noise.fidelity:.4g}",
                "expected": v.expected,
                "verdict": "PASS" if v.passed else "FAIL",
                "reasons": "; ".join(v.reasons),
            }
        )
    return rows


def write_csv(res: CheckResult, path: str | Path) -> Path:
    return append_csv(path, CSV_COLUMNS, csv_rows(res))
