"""Routing attribution: which part of a logprob difference comes from the engine's expert choices and which from
its kernels, judged apart (issue 43). Needs both runs' per-token, per-MoE-layer expert ids
(``PromptLogprobs.routed_experts``: engine option ``capture_routing``); the reference's per-layer top-k margins
(``routed_margins``) say whether a flip sits below rounding; top-k weights (``routed_weights``, hf and triton) let
a wrong weighting be seen where the ids agree.

Definitions (a = engine under test, b = reference; tokens 0..n-2 of a prompt, the ones logprob positions see):
  agree(t, l)        token t's set of top-k expert ids at MoE layer l is the same in a and b (order ignored)
  routing-clean      position i (predicting token i+1) is routing-clean when agree(t, l) for every token t <= i
                     and every layer l. Causal on purpose: position i's hidden state at layer l attends to the
                     states of tokens 0..i, so a flip at an earlier token changes it even where its own experts
                     agree; over routing-clean positions the difference is kernel, LoRA and rounding error only.
  first-order flip   not agree(t, l) while every token <= t agrees at every layer < l: the router's input there was
                     computed from identically routed states, so the flip is not a consequence of another flip.
  rounding           eps = the near-tie margin of the compared dtypes (metrics.NEAR_TIE_EPS, the coarsest dtype);
                     a flip is explained by rounding when the reference's margin there is at most ``flip_limit``
                     (default ROUTER_FAULT_FACTOR x eps); a first-layer weight error is rounding up to
                     ``weight_limit`` (default ROUTER_FAULT_FACTOR x the coarsest dtype's relative spacing: the
                     first router's input has passed through one attention only). lpdiff check --routing-replay
                     derives both from the flips and weight errors of its noise pair instead.

Parts and the fault's name:
  kernel part   k2 and max |d| over routing-clean positions against the verdict's threshold.
  router part   fails on a first-order flip at a reference margin above ``flip_limit``, or, where both runs carry
                weights, a relative top-k weight error above ``weight_limit`` at the first MoE layer on tokens
                whose experts agree (the first router's input passes through no expert kernel); reads "after
                kernel error" when such flips sit only at later layers and the kernel part fails.
  fault         "router fault" when the router part fails at the first MoE layer; else "kernel fault" when the
                kernel part fails (flips at later layers may follow from the kernel error); else "router fault"
                when the router part fails at a later layer (the kernels agree where routing agrees); else none.
                An attention or embedding fault that moves the first router's input beyond rounding reads as a
                router fault here; the routing-replay comparison (harness/commands/replay.py) tells them apart.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np

from lpdiff.harness.pipeline.metrics import near_tie_eps
from lpdiff.harness.types import LogprobRun, PromptLogprobs

ROUTER_FAULT_FACTOR = 10.0  # a flip or weight error this many times the rounding margin is not rounding
SPACING = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}  # relative spacing at 1.0
MAX_LISTED_FLIPS = 200  # first-order flips listed per lane for reports


def has_routing(*runs: LogprobRun) -> bool:
    return all(p.routed_experts is not None for r in runs for p in r.prompts)


def _routed(p: PromptLogprobs) -> np.ndarray:
    """A prompt's (n, L, K) routed expert ids (has_routing said they are there)."""
    if p.routed_experts is None:
        raise ValueError("a prompt without captured routing (routed_experts)")
    return p.routed_experts


def _agree(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n, L, K) ids -> (n, L) True where the sets agree or either side reported none (-1)."""
    same = (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(-1)
    return same | (a < 0).any(-1) | (b < 0).any(-1)


def _weight_error(a_ids, a_w, b_ids, b_w) -> np.ndarray:
    """(n, K) at one layer -> (n,) max |wa - wb| / sum |wb| with both rows ordered by expert id."""
    oa, ob = np.argsort(a_ids, axis=-1), np.argsort(b_ids, axis=-1)
    wa, wb = np.take_along_axis(a_w, oa, -1).astype(np.float64), np.take_along_axis(b_w, ob, -1).astype(np.float64)
    return np.abs(wa - wb).max(-1) / np.maximum(np.abs(wb).sum(-1), 1e-30)


def attribute(
    a: LogprobRun,
    b: LogprobRun,
    dtypes: Sequence[str],
    threshold=None,
    flip_limit: float | None = None,
    weight_limit: float | None = None,
    kernel_fail: bool | None = None,
) -> dict[str, Any] | None:
    """The routing part of a verdict of ``a`` against reference ``b`` (module docstring), or None when either run
    lacks expert ids. ``dtypes``: the two runs' dtypes (the coarsest sets the rounding); ``threshold``: the
    verdict's (k2, max_abs) for the kernel part (None: not judged); ``kernel_fail``: the kernel part as the caller
    judged it instead (the routing-replay comparison, where every position is routed as the engine routed it)."""
    if not has_routing(a, b):
        return None
    eps = near_tie_eps(*dtypes)
    flip_limit = ROUTER_FAULT_FACTOR * eps if flip_limit is None else flip_limit
    weight_limit = ROUTER_FAULT_FACTOR * max(SPACING[d] for d in dtypes) if weight_limit is None else weight_limit
    routed = [(_routed(p), _routed(q)) for p, q in zip(a.prompts, b.prompts)]
    shapes = {(pe.shape[1:], qe.shape[1:]) for pe, qe in routed}
    if any(x != y for x, y in shapes):
        raise ValueError(
            f"the runs route over different (MoE layers, top_k): {min(shapes)}; were they made on the same model?"
        )
    L, K = routed[0][0].shape[1:]
    agree_all, clean_pos, d_all, flips = [], [], [], []
    layer_flips = np.zeros(L, dtype=np.int64)
    first_weight_err = []
    for pi, (p, q) in enumerate(zip(a.prompts, b.prompts)):
        pe, qe = routed[pi]
        n = p.token_ids.shape[0] - 1  # tokens that positions see
        agree = _agree(pe[:n], qe[:n])
        agree_all.append(agree)
        clean_pos.append(np.logical_and.accumulate(agree.all(1)))
        d_all.append(p.logprobs.astype(np.float64) - q.logprobs.astype(np.float64))
        layer_flips += (~agree).sum(0)
        # ctx[t, l]: every token <= t agrees at every layer < l
        before = np.concatenate([np.ones((n, 1), bool), np.logical_and.accumulate(agree, axis=1)[:, :-1]], axis=1)
        ctx = np.logical_and.accumulate(before, axis=0)
        margins = q.routed_margins[:n] if q.routed_margins is not None else np.full((n, L), np.nan, np.float32)
        for t, layer in zip(*np.nonzero(~agree & ctx)):
            flips.append((pi, int(t), int(layer), float(margins[t, layer])))
        if p.routed_weights is not None and q.routed_weights is not None:
            ok = agree[:, 0]
            err = _weight_error(pe[:n, 0], p.routed_weights[:n, 0], qe[:n, 0], q.routed_weights[:n, 0])
            first_weight_err.append(err[ok])
    agree = np.concatenate(agree_all)
    clean = np.concatenate(clean_pos)
    d = np.concatenate(d_all)
    margins = np.array([f[3] for f in flips], dtype=np.float64)
    above = [f for f in flips if not f[3] <= flip_limit]  # a NaN margin (reference without margins) is not rounding
    werr = float(np.concatenate(first_weight_err).max(initial=0.0)) if first_weight_err else None
    router_first = any(f[2] == 0 for f in above) or (werr is not None and werr > weight_limit)
    router_fail = bool(above) or router_first
    dc = d[clean]
    clean_k2 = float(0.5 * np.mean(dc * dc)) if dc.size else None
    clean_max = float(np.abs(dc).max()) if dc.size else None
    kernel_given = kernel_fail is not None
    if threshold is not None and dc.size and not kernel_given:
        kernel_fail = not (clean_k2 <= threshold.k2 and clean_max <= threshold.max_abs)
    fault = (
        "router fault" if router_first else "kernel fault" if kernel_fail else "router fault" if router_fail else None
    )
    router_part = "FAIL" if fault == "router fault" else "after kernel error" if router_fail else "PASS"
    out = {
        "layers": int(L),
        "top_k": int(K),
        "tokens": int(agree.shape[0]),
        "token_agreement": float(agree.all(1).mean()) if agree.size else 1.0,
        "per_layer_agreement": [float(x) for x in agree.mean(0)] if agree.size else [1.0] * L,
        "flips_per_layer": layer_flips.tolist(),
        "clean_share": float(clean.mean()) if clean.size else 1.0,
        "clean_positions": int(clean.sum()),
        "clean_k2": clean_k2,
        "clean_max_abs": clean_max,
        "first_order_flips": len(flips),
        "flips_above_rounding": len(above),
        "max_flip_margin": float(np.nanmax(margins)) if margins.size and np.isfinite(margins).any() else None,
        "rounding_eps": eps,
        "flip_limit": flip_limit,
        "first_layer_weight_error": werr,
        "weight_limit": weight_limit,
        "kernel_part": "n/a" if kernel_fail is None else "FAIL" if kernel_fail else "PASS",
        "kernel_judged_on": "routing replay" if kernel_given else "routing-clean positions",
        "router_part": router_part,
        "fault": fault,
        "flips": [list(f) for f in flips[:MAX_LISTED_FLIPS]],  # [prompt, token, layer, reference margin]
    }
    out["summary"] = summary(out)
    return out


def summary(r: dict[str, Any]) -> str:
    """One line: agreement and both parts (the fault's name is r["fault"])."""
    kern = (
        "not judged"
        if r["kernel_part"] == "n/a"
        else f"{r['kernel_part']} (routing replay)"
        if r.get("kernel_judged_on") == "routing replay"
        else (
            f"{r['kernel_part']} (k2 {r['clean_k2']:.3g}, max |Δ| {r['clean_max_abs']:.3g} over {r['clean_positions']} "
            f"routing-clean positions)"
            if r["clean_positions"]
            else "no routing-clean positions"
        )
    )
    flips = (
        f"{r['first_order_flips']} first-order flips, {r['flips_above_rounding']} above the "
        f"{r['flip_limit']:.3g} rounding limit"
    )
    if r["max_flip_margin"] is not None:
        flips += f" (largest reference margin {r['max_flip_margin']:.3g})"
    if r["first_layer_weight_error"] is not None:
        flips += f", first-layer weight error {r['first_layer_weight_error']:.3g} (limit {r['weight_limit']:.3g})"
    return (
        f"routing: {r['token_agreement']:.1%} of tokens routed as the reference at every layer, "
        f"{r['clean_share']:.1%} of positions routing-clean; kernel part {kern}; router part {r['router_part']}: "
        f"{flips}"
    )


def apply(verdict, routing: dict[str, Any] | None) -> None:
    """Attach the routing part to a Verdict: a failing router part fails it; the fault's name goes in its reasons
    when it fails, the summary in its notes."""
    if routing is None:
        return
    verdict.routing = routing
    verdict.notes.append(routing["summary"] + (f"; {routing['fault']}" if routing["fault"] else ""))
    if routing["router_part"] == "FAIL":
        verdict.passed = False
        verdict.reasons.append(
            f"routing: {routing['flips_above_rounding']} first-order expert flips above the "
            f"rounding limit {routing['flip_limit']:.3g}"
            + (
                f" / first-layer weight error {routing['first_layer_weight_error']:.3g}"
                if routing["first_layer_weight_error"] is not None
                else ""
            )
        )
    if not verdict.passed and routing["fault"]:
        verdict.reasons.append(f"{routing['fault']}: {routing['summary']}")


def flip_margin_noise(pairs: Sequence[tuple[LogprobRun, LogprobRun]], dtypes: Sequence[str]) -> tuple[float, float]:
    """Largest reference margin at a first-order flip and largest first-layer weight error over runs of two correct
    implementations (the noise pair): what rounding alone does, for flip_limit and weight_limit."""
    m, w = 0.0, 0.0
    for a, b in pairs:
        r = attribute(a, b, dtypes, flip_limit=float("inf"), weight_limit=float("inf"))
        if r is None:
            continue
        m = max(m, r["max_flip_margin"] or 0.0)
        w = max(w, r["first_layer_weight_error"] or 0.0)
    return m, w


# -- report --------------------------------------------------------------------------------------------------------


def routing_html(routing: dict[str, Any] | None) -> str:
    """The HTML report's routing panel of one lane: agreement per MoE layer (bars), first-order flips per layer
    and token with the reference's margin, and the summary line. Empty for a lane without routing."""
    if not routing:
        return ""
    per = routing.get("per_layer_agreement") or []
    flips = routing.get("flips") or []
    w, h, pad = 360, 120, 30
    n = max(len(per), 1)
    bw = (w - pad - 6) / n
    bars = []
    for i, share in enumerate(per):
        x = pad + i * bw
        bh = (h - 30) * float(share)
        bars.append(
            f'<rect x="{x + 1:.1f}" y="{h - 18 - bh:.1f}" width="{max(bw - 2, 1):.1f}" height="{bh:.1f}" '
            f'fill="#3060c0"><title>layer {i}: {share:.2%} of tokens agree</title></rect>'
        )
        if n <= 48:
            bars.append(f'<text x="{x + bw / 2:.1f}" y="{h - 6}" text-anchor="middle">{i}</text>')
    limit = routing.get("flip_limit") or 0.0
    dots = []
    tokens = max([f[1] for f in flips], default=0) + 1
    for p, t, layer, margin in flips:
        x = pad + (t / max(tokens, 1)) * (w - pad - 6)
        y = 10 + (layer + 0.5) * (h - 30) / n
        color = "#b71c1c" if not margin <= limit else "#e8890c"
        dots.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"><title>prompt {p} token {t} layer '
            f"{layer}: reference margin {margin:.3g}</title></circle>"
        )
    svg = (
        f'<svg width="{w}" height="{h}"><text x="4" y="10">agreement per MoE layer</text>{"".join(bars)}</svg>'
        f'<svg width="{w}" height="{h}"><text x="4" y="10">first-order flips (token x layer; red: above the '
        f"rounding limit)</text>{''.join(dots)}</svg>"
    )
    summary = html.escape(routing.get("summary", "") + (f"; {routing['fault']}" if routing.get("fault") else ""))
    return f'<div class="routing"><div class="plots">{svg}</div><div>{summary}</div></div>'
