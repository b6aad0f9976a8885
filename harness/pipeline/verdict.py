"""Verdicts: metrics held against a threshold, with every exceeded limit named alongside both numbers.

Near-tie positions (router margin below ε) are never silently dropped: by default the verdict is taken over all
positions and, when only the near-ties break it, the reason says so; ``exclude_near_ties=True`` judges the clean
positions and records the excluded share in the notes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lpdiff.harness.pipeline.metrics import Metrics, nonfinite_reason
from lpdiff.harness.pipeline.thresholds import Threshold
from lpdiff.harness.spec.errors import InputError

Fidelity = float | Mapping[str, float] | None  # one number, or one per module group
MIN_CLEAN_SHARE = 0.5  # judging only clean positions needs at least this share of them


@dataclass(slots=True)
class Verdict:
    model: str
    engine_pair: str
    dtype: str
    tp: int | None
    adapter: str | None
    metrics: Metrics
    delta_fidelity: Fidelity
    threshold: Threshold
    passed: bool
    reasons: list[str]  # one per exceeded limit, naming the metric, its value and the limit
    near_tie_share: float | None
    notes: list[str] = field(default_factory=list)  # context that does not decide pass/fail
    expected: str = "PASS"  # "FAIL" for lanes that must fail (bug-zoo faults, known defects); reports mark them
    detail: dict[str, Any] | None = None  # per-prompt d and near-tie positions for reports (metrics.position_detail)
    # routing part (harness/pipeline/routing.py attribute: expert agreement, kernel and router parts, the fault's
    # name) where both runs carried expert ids
    routing: dict[str, Any] | None = None
    next_step: str = ""  # for a lane that did not come out as expected: the command that localises it (next_step)


@dataclass(frozen=True, slots=True)
class LaneId:
    """Which lane a verdict is about: its model, engine pair, dtype, TP size and adapter ("-" or "base": base rows)."""

    model: str
    engine_pair: str
    dtype: str
    tp: int | None
    adapter: str | None

    @property
    def label(self) -> str:
        """The lane as failure messages name it."""
        return "base" if self.adapter in (None, "-") else self.adapter


def _exceeded(
    m: Metrics, t: Threshold, fidelity: Fidelity, lane: str | None = None, nonfinite: bool = True
) -> list[str]:
    if m.num_positions == 0:
        return ["no positions to judge"]
    out = []
    if nonfinite and m.num_nonfinite:
        out.append(nonfinite_reason(m.num_nonfinite, m.num_positions, m.first_nonfinite, lane))
    # "not <=" so that a NaN metric fails instead of slipping past a ">" test
    for label, value, limit in (("k2", m.k2, t.k2), ("max |Δ|", m.max_abs, t.max_abs)):
        if not value <= limit:
            out.append(f"{label} {value:.3g} > threshold {limit:.3g}")
    if fidelity is not None and t.delta_fidelity is not None:
        groups = fidelity.items() if isinstance(fidelity, Mapping) else [(None, fidelity)]
        for group, value in groups:
            if not value <= t.delta_fidelity:
                where = f" [{group}]" if group else ""
                out.append(f"delta fidelity{where} {value:.3g} > threshold {t.delta_fidelity:.3g}")
    return out


def judge(
    metrics: Metrics,
    threshold: Threshold,
    delta_fidelity: Fidelity = None,
    *,
    adapter: str | None = None,
    exclude_near_ties: bool = False,
    lane: LaneId | None = None,
    groups: Mapping[str, float] | None = None,
    detail: dict[str, Any] | None = None,
    next_step: str = "",
    expected: str = "PASS",
) -> Verdict:
    """Pass when k2, max |Δ| and (if both given) delta fidelity are within ``threshold`` and no logprob is
    NaN/inf. The verdict's identity is ``lane``; without one, model, engine pair, dtype and TP come from the
    threshold (which lookup() filled for this lane) and the adapter from ``adapter``.
    A NaN/inf logprob anywhere, near-tie positions included, is a FAIL naming the lane (``adapter``), the prompt
    and the position of the first (metrics.nonfinite_reason), whatever the other metrics say. ``groups``: a
    multi-group lane's per-group delta fidelity from the batch's single-group lanes, named in the notes (and in
    the reasons when the lane's own delta fidelity fails). ``next_step`` is kept only for a lane that did not
    come out as ``expected``."""
    if lane is not None:
        adapter = lane.label
    notes, reasons_pre = [], []
    if threshold.source != "measured" or threshold.match != "exact":
        notes.append(f"threshold is {threshold.provenance}: {threshold.note}".strip())
    if delta_fidelity is not None and threshold.delta_fidelity is None:
        notes.append("delta fidelity not judged: the threshold has no delta-fidelity limit")
    judged = metrics
    if exclude_near_ties:
        if metrics.clean is None:
            raise ValueError(
                "exclude_near_ties needs router margins, and neither run reports them; use an engine "
                "that exposes routing (hf, triton) or judge all positions"
            )
        judged = metrics.clean
        if judged.num_positions < MIN_CLEAN_SHARE * metrics.num_positions:
            # so many near-ties that the clean rest could no longer show a real failure: judge nothing silently
            reasons_pre = [
                (
                    f"only {judged.num_positions} of {metrics.num_positions} positions are free of router "
                    f"near-ties (< {MIN_CLEAN_SHARE:.0%}): too few to judge; use fp32 or a decisive model"
                )
            ]
        notes.append(
            f"judged on {judged.num_positions} positions; the {metrics.near_tie_share:.1%} at or after a "
            "router near-tie were excluded"
        )
    reasons = reasons_pre + _exceeded(judged, threshold, delta_fidelity, adapter, nonfinite=judged is metrics)
    if judged is not metrics and metrics.num_nonfinite:  # counted over every position: near-ties never hide one
        reasons.insert(
            0, nonfinite_reason(metrics.num_nonfinite, metrics.num_positions, metrics.first_nonfinite, adapter)
        )
    clean = metrics.clean
    if (
        reasons
        and not exclude_near_ties
        and clean is not None
        and clean.num_positions
        and not _exceeded(clean, threshold, None)
    ):
        reasons.append(
            f"the {clean.num_positions} positions without a router near-tie are within the threshold "
            f"(k2 {clean.k2:.3g}, max |Δ| {clean.max_abs:.3g}): the excess comes from the "
            f"{metrics.near_tie_share:.1%} near-tie positions"
        )
    if groups:
        notes.append(
            "delta fidelity of this batch's single-group lanes: " + ", ".join(f"{g} {f:.3g}" for g, f in groups.items())
        )
        limit = threshold.delta_fidelity
        if limit is not None and any(r.startswith("delta fidelity ") for r in reasons):
            reasons += [
                f"delta fidelity [{g}] {f:.3g} > threshold {limit:.3g} (the {g}-only lane of this batch)"
                for g, f in groups.items()
                if not f <= limit
            ]
    who = lane or LaneId(threshold.model, threshold.engine_pair, threshold.dtype, threshold.tp, adapter)
    passed = not reasons
    return Verdict(
        model=who.model,
        engine_pair=who.engine_pair,
        dtype=who.dtype,
        tp=who.tp,
        adapter=who.adapter,
        metrics=metrics,
        delta_fidelity=delta_fidelity,
        threshold=threshold,
        passed=passed,
        reasons=reasons,
        near_tie_share=metrics.near_tie_share,
        notes=notes,
        expected=expected,
        detail=detail,
        next_step="" if passed == (expected == "PASS") else next_step,
    )


def _engine_of(engine_pair: str) -> tuple[str, str, str]:
    """ "triton:float32-vs-hf:float32" -> ("triton", "float32", "hf")."""
    test, _, ref = engine_pair.partition("-vs-")
    engine, _, dtype = test.partition(":")
    return engine, dtype, ref.partition(":")[0]


def bisect_command(
    model: str, adapters: Sequence[str] | None = (), tp: int | None = 1, options: Mapping[str, Any] | None = None
) -> str:
    """The ``lpdiff bisect`` command that re-runs a triton lane module by module against HF+PEFT: the same model,
    the same adapters (a mixed batch when several, as the run's session), the same TP size and bug-zoo fault."""
    cmd = f"lpdiff bisect {shlex.quote(model)}" + "".join(f" --adapter {shlex.quote(a)}" for a in adapters or ())
    cmd += f" --tp {tp or 1}"
    fault = (options or {}).get("fault")
    return cmd + (f" --fault {shlex.quote(str(fault))}" if fault else "")


def next_step(
    engine_pair: str,
    model: str,
    adapter: str | None,
    tp: int | None = 1,
    adapters: Sequence[str] | None = None,
    options: Mapping[str, Any] | None = None,
    bisect: bool = True,
) -> str:
    """What to run after a lane came out unexpectedly, from the engines' capabilities: an engine that bisects
    (lpdiff's own runtime) against a reference that captures its layers -> the bisect command naming the first
    layer and module that leaves the reference (``adapters``: the run's batch; default the lane's adapter); an engine
    against its own stored runs -> the stack differs from the baselines'; another engine -> doctor where it knows the
    engine's adapter handling, and metamorphic (the engine against itself); ``bisect`` False (an arch bisect cannot
    capture, commands/bisect.ARCHS): a bisecting engine gets metamorphic too."""
    engine, dtype, ref = _engine_of(engine_pair)
    caps, ref_caps = _capabilities(engine), _capabilities(ref)
    lane = None if adapter in (None, "-", "base") else adapter
    m = shlex.quote(model)
    bisects = caps is not None and caps.bisects
    if bisects and bisect and engine != ref and ref_caps is not None and ref_caps.per_layer_capture:
        return bisect_command(model, adapters if adapters is not None else ([lane] if lane else []), tp, options)
    if engine == ref:
        label = caps.label if caps is not None else engine
        return (
            f"{label} differs from its own stored runs: compare `pip list` with constraints.txt (the stack the "
            f"baselines were measured with), or `lpdiff regen --model {m} --baselines DIR` into a new store"
        )
    if lane is None and bisects:
        lane = (list(adapters or ()) or ["all"])[0]  # base rows go wrong with the adapters beside them
    if lane is None:
        return (
            f"lpdiff compare --model {m} --engine {engine} --dtype {dtype or 'float32'} --against {ref} --tp {tp or 1}"
        )
    a = shlex.quote(lane)
    doctor = f"lpdiff doctor {m} {a} --engine {engine}; " if caps is not None and caps.adapter_doctor else ""
    return f"{doctor}lpdiff metamorphic {m} {a} --engine {engine} --tp {tp or 1}"


def _capabilities(engine: str):
    """The engine's Capabilities; None for a name the registry does not hold (a pair read from an old document)."""
    from lpdiff.engines import ENGINES, capabilities

    return capabilities(engine) if engine in ENGINES else None


def _plain(obj: Any) -> Any:
    """JSON-safe copy: NaN and inf become strings (JSON has no such numbers, and None would hide them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


SCHEMA_VERSION = 1  # of the JSON document to_json writes; readers refuse a newer one


def to_json(verdicts: Sequence[Verdict], *, metamorphic: Sequence[Mapping[str, Any]] = ()) -> str:
    """``{"schema_version", "lpdiff_version", "created", "verdicts": [...]}`` plus, when given, ``"metamorphic"``:
    metamorphic reports as plain dicts (``dataclasses.asdict`` of a Report), which ``lpdiff report`` draws."""
    from lpdiff import __version__

    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "lpdiff_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "verdicts": [_plain(dataclasses.asdict(v)) for v in verdicts],
    }
    if metamorphic:
        doc["metamorphic"] = _plain(list(metamorphic))
    return json.dumps(doc, indent=1, sort_keys=True)


def load_document(text: str) -> dict[str, Any]:
    """The parsed document; the bare list older versions wrote reads as schema version 0."""
    doc = json.loads(text)
    if isinstance(doc, list):
        return {"schema_version": 0, "verdicts": doc}
    if not isinstance(doc, dict) or "verdicts" not in doc:
        raise InputError("not an lpdiff verdict document: expected a JSON object with 'verdicts'")
    if doc.get("schema_version", 0) > SCHEMA_VERSION:
        raise InputError(
            f"verdict document has schema_version {doc['schema_version']}; this lpdiff reads up to "
            f"{SCHEMA_VERSION}: upgrade lpdiff"
        )
    return doc


def _num(x: Any) -> Any:
    return float(x) if isinstance(x, str) and x in ("nan", "inf", "-inf") else x


def _metrics(d: Mapping[str, Any] | None) -> Metrics | None:
    if d is None:
        return None
    d = {k: _num(v) for k, v in d.items()}
    d["clean"] = _metrics(d.get("clean"))
    return Metrics(**d)


def from_json(text: str) -> list[Verdict]:
    """Inverse of to_json (pytest-xdist workers ship verdicts to the controller this way)."""
    out = []
    for d in load_document(text)["verdicts"]:
        d = dict(d)
        d["metrics"] = _metrics(d["metrics"])
        d["threshold"] = Threshold(**{k: _num(v) for k, v in d["threshold"].items()})
        fid = d["delta_fidelity"]
        d["delta_fidelity"] = {k: _num(v) for k, v in fid.items()} if isinstance(fid, Mapping) else _num(fid)
        out.append(Verdict(**d))
    return out
