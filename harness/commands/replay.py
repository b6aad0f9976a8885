"""``lpdiff check --routing-replay``: the engine under test judged against the HF+PEFT fp32 reference run with the
engine's own expert choices forced (routing replay), so that bf16 routing flips leave the comparison; the flips
themselves are judged apart by the routing part of each verdict (harness/pipeline/routing.py), so a router that
picks wrong experts FAILs there instead of being hidden by the replay.

Runs (the engine with option ``capture_routing``; HF in-process with ``capture_routing``):
  R    HF fp32 (the reference), unreplayed: its expert ids and per-layer margins judge the engine's routing.
  N_b, N_a  the reference's noise pair (noise.noise_pair: bf16 vs fp32 for a bf16 engine, two expert kernels for
       fp32): N_b captured; N_a unreplayed (its flips and first-layer weight errors against N_b set the router
       part's rounding limits) and N_a replayed with N_b's ids (its |d| against N_b is the replayed reference noise).
  E    the engine, ``k`` runs of the mixed batch (rerun noise, as lpdiff check).
  R_E  HF fp32 replayed with E's first-run ids per lane: what E is judged against.
Threshold = REPLAY_FACTOR[dtype] x max(replayed reference noise, rerun noise); routing limits = max(the routing
module's defaults, that factor x the noise pair's largest first-order flip margin / first-layer weight error).
The kernel part of a verdict is the replayed comparison itself; the fault is named as routing.attribute says.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from lpdiff.engines import ENGINES, REFERENCE_ENGINE, capabilities
from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.commands.check import (
    FACTOR,
    Case,
    CheckRequest,
    CheckResult,
    check_result,
    engine_pair,
    run_check,
    served_lanes,
)
from lpdiff.harness.pipeline.metrics import compare, delta_fidelity, near_tie_eps, position_detail
from lpdiff.harness.pipeline.noise import REFERENCE_DTYPE, Noise, noise_pair, pair_noise, rerun_noise, threshold_from
from lpdiff.harness.pipeline.routing import ROUTER_FAULT_FACTOR, SPACING, apply, attribute, flip_margin_noise
from lpdiff.harness.pipeline.session import Lanes, engine_options, run_session
from lpdiff.harness.pipeline.verdict import judge
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import AdapterSpec, LogprobRun, PromptLogprobs


class _ReplaysRouting(Protocol):
    """An engine whose Capabilities.routing_replay is True: prompt_logprobs takes forced expert ids."""

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], adapter: Any = None, top_k: int = 0, routing: Any = None
    ) -> list[PromptLogprobs]: ...


CAPTURE = {"capture_routing": True}
# With routing replayed, a bf16 engine's noise is kernel rounding alone, and the verdict can take the 10x of the
# project's other noise-of-one-kind rules (bisect, metamorphic); check's bf16 3x was set against noise dominated by
# routing flips, and caps threshold / noise at 3 by construction (benchmarks/results/detection.md). fp32: check's.
REPLAY_FACTOR = {"bfloat16": 10.0, "float16": 10.0, "float32": FACTOR["float32"]}


def reference_session(
    case: Case,
    reference: str,
    adapters: dict[str, AdapterSpec],
    dtype: str,
    options: dict,
    passes: Sequence[tuple[Lanes | None, dict | None]] = ((None, None),),
) -> list[Lanes]:
    """The reference (in-process, capturing routing) over the case's prompts, one engine session (a full-width
    model is built once), one call per pass ``(routing, lanes)``: ``lanes`` maps each output lane to the adapter it
    runs (None: base + every adapter, each under its own name); ``routing`` (lane -> a run with expert ids, or None)
    replays those ids per lane."""
    cfg = EngineConfig(model=case.spec, adapters=dict(adapters), dtype=dtype, options={**options, **CAPTURE})
    prompts, n, out = case.prompts, len(case.prompts), []
    with open_engine(reference, cfg) as eng:
        version = eng.version()
        for routing, lanes in passes:
            lanes = lanes if lanes is not None else {None: None, **{a: a for a in adapters}}
            ids = None if routing is None else [q.routed_experts for lane in lanes for q in routing[lane].prompts]
            flat = cast(_ReplaysRouting, eng).prompt_logprobs(  # checker() refused any other reference
                [p for _ in lanes for p in prompts], adapter=[a for a in lanes.values() for _ in prompts], routing=ids
            )
            meta = {
                "engine": reference,
                "engine_version": version,
                "dtype": dtype,
                "routing_replay": routing is not None,
            }
            out.append(
                {lane: LogprobRun(flat[i * n : (i + 1) * n], {**meta, "adapter": lane}) for i, lane in enumerate(lanes)}
            )
    return out


def reference_lanes(case: Case, lanes) -> dict[str | None, str | None]:
    """Each served lane (``name.layout``, None = base) -> the correct adapter the reference runs for it."""
    return {
        lane: None if lane is None else (case.plans[lane.split(".")[0]].broken_from or lane.split(".")[0])
        for lane in [None, *(lane for lane in lanes if lane is not None)]
    }


def reference_adapters(case: Case) -> dict[str, AdapterSpec]:
    """The correct adapters, PEFT 3D under the text model's names: what the reference runs."""
    return {n: AdapterSpec(n, case.files[(n, "peft3d")].path) for n, p in case.plans.items() if not p.broken_from}


def replayed_references(case: Case, runs: Sequence[Lanes], reference: str = REFERENCE_ENGINE) -> list[Lanes]:
    """R_E for each engine run: the reference in fp32 over every lane, each with that run's expert ids for the lane
    forced (one reference session for all of them)."""
    return reference_session(
        case,
        reference,
        reference_adapters(case),
        REFERENCE_DTYPE,
        {},
        [(run, reference_lanes(case, run)) for run in runs],
    )


def _replays(reference: str) -> None:
    if not capabilities(reference).routing_replay:
        replaying = ", ".join(e for e in ENGINES if capabilities(e).routing_replay)
        raise InputError(
            f"--routing-replay forces expert ids in the reference's routers, which {reference} cannot take: use "
            f"--reference {replaying}"
        )


def checker(
    routing_replay: bool, reference: str, store
) -> Callable[[CheckRequest, Callable[[str], None]], CheckResult]:
    """lpdiff check's run function: check.run_check on ``store``, or replay_check (a reference that takes forced
    expert ids, ``Capabilities.routing_replay``); a bad combination is refused here, before any model is built."""
    if not capabilities(reference).lora_fp32:
        raise InputError(
            f"check runs the reference in fp32 with LoRA, which {reference} cannot: use --reference {REFERENCE_ENGINE}"
        )
    if not routing_replay:
        return functools.partial(run_check, store=store)
    _replays(reference)
    return replay_check


def replay_check(req: CheckRequest, log: Callable[[str], None] = print, factor: float | None = None) -> CheckResult:
    """check.run_check's contract (a CheckResult, verdicts named ``name.layout``), judged against the replayed
    reference (module docstring); ``factor``: the threshold's, default REPLAY_FACTOR[dtype]."""
    case, engine, tp, reference, k, dtype = req.case, req.engine, req.tp, req.reference, req.k, req.dtype
    _replays(reference)
    ref_adapters = reference_adapters(case)
    t0 = time.perf_counter()
    ref32 = reference_session(case, reference, ref_adapters, REFERENCE_DTYPE, {})[0]
    (da, oa), (db, ob) = noise_pair(reference, dtype)
    nb = ref32 if (db, ob) == (REFERENCE_DTYPE, {}) else reference_session(case, reference, ref_adapters, db, ob)[0]
    na, na_replayed = reference_session(case, reference, ref_adapters, da, oa, [(None, None), (nb, None)])
    dtypes = (dtype, REFERENCE_DTYPE)
    factor = REPLAY_FACTOR[dtype] if factor is None else factor
    ref_noise = pair_noise(na_replayed, nb, list(ref32))
    flip_noise, weight_noise = flip_margin_noise([(na[lane], nb[lane]) for lane in ref32], (da, db))
    flip_limit = max(ROUTER_FAULT_FACTOR * near_tie_eps(*dtypes), factor * flip_noise)
    weight_limit = max(ROUTER_FAULT_FACTOR * max(SPACING[d] for d in dtypes), factor * weight_noise)
    unreplayed = pair_noise(na, nb, list(ref32))
    log(
        f"[check] replay: reference noise {ref_noise.describe()} replayed, {unreplayed.describe()} unreplayed; "
        f"noise-pair flips up to margin {flip_noise:.3g}, first-layer weight error {weight_noise:.3g} "
        f"({time.perf_counter() - t0:.1f}s)"
    )

    lanes, refused = served_lanes(req)
    opts = {**engine_options(engine), **(req.options or {}), **CAPTURE}
    pair = engine_pair(engine, dtype, reference, opts).replace(f"-vs-{reference}:", f"-vs-{reference}[replay]:")
    try:
        sess = run_session(engine, case.spec, lanes, case.prompts, dtype, tp, options=opts, reruns=k)
    except Exception as e:  # noqa: BLE001 - a dead or refusing engine is a verdict, not a crashed session
        return check_result(req, pair, refused, ref_noise, error=e)
    got = sess.first
    missing = [lane for lane, run in got.items() if any(p.routed_experts is None for p in run.prompts)]
    if missing:
        raise InputError(
            f"{engine} returned no expert ids for lanes {missing}: it cannot capture routing here, so "
            "there is nothing to replay"
        )
    ref_of = reference_lanes(case, lanes)
    replayed = replayed_references(case, [got], reference)[0]
    reruns = rerun_noise(sess.runs)
    noise = Noise().merge(ref_noise, reruns)
    t = threshold_from(
        noise,
        factor,
        note=f"noise = max of {reference} {da}{oa or ''}-vs-{db}{ob or ''} with "
        f"{db}'s expert ids replayed ({ref_noise.describe()}) and {engine} rerun noise over {k} runs "
        f"({reruns.describe()}), same model and prompts",
    )
    t.model, t.engine_pair, t.dtype, t.tp = case.spec.name, pair, dtype, tp
    res = check_result(req, pair, refused, ref_noise, sess, reruns, t)
    eps = near_tie_eps(*dtypes)
    for lane in [None, *lanes]:
        m = compare(got[lane], replayed[lane], near_tie_eps=eps)
        fid = None if lane is None else delta_fidelity(got[lane], got[None], replayed[lane], replayed[None])
        v = judge(m, t, fid, adapter=lane or "base")
        name = None if lane is None else lane.split(".")[0]
        v.expected = case.plans[name].expected if name else "PASS"
        v.detail = position_detail(got[lane], replayed[lane], eps)
        apply(
            v,
            attribute(
                got[lane],
                ref32[ref_of[lane]],
                dtypes,
                flip_limit=flip_limit,
                weight_limit=weight_limit,
                kernel_fail=not v.passed,
            ),
        )
        res.verdicts.append(v)
    return res
