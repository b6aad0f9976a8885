"""Logprob-diff metrics (docs/metrics.md): a = engine under test, b = reference, d = a - b per position.

All arithmetic is float64 whatever the runs store, so the metrics of two fp32 runs that differ in the last bit are
not themselves rounding noise. Pure numpy: nothing here needs torch or a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lpdiff.harness.types import LogprobRun

TAIL_CUTS = (0.1, 0.5, 1.0)  # the |d| levels whose exceedance shares are reported
K3_CLAMP = 10.0  # miles clamps the log-ratio before exp() so one wild position cannot overflow k3
# The near-tie rule, the only one: a routing margin below this may flip under the rounding of the compared dtype
# (about the relative rounding of a router logit of magnitude ~2-5: bf16 keeps 8 significant bits, fp16 11, fp32
# 24), with headroom. The coarsest dtype of a comparison decides.
NEAR_TIE_EPS = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 4e-3}
_TINY = 1e-300  # floor for probabilities inside log(); keeps 0·log 0 = 0 and a zero denominator finite


@dataclass(slots=True)
class Metrics:
    """Aggregates over a set of positions. ``clean`` repeats them over positions that are not near-ties (None when
    neither run reports routing); ``near_tie_share`` is the flagged share (None likewise)."""

    num_positions: int
    k1: float
    k2: float
    k3: float
    max_abs: float
    mean_abs: float
    p99_abs: float
    over_0_1: float  # share of positions with |d| > 0.1
    over_0_5: float
    over_1_0: float
    num_nonfinite: int  # positions where either run's logprob is NaN or inf (a bug in itself)
    topk_kl: float | None = None  # mean top-k KL(b||a); None unless both runs carry top-k
    top1_agreement: float | None = None  # argmax match rate; None unless both runs carry top-k
    full_kl: float | None = None  # mean exact KL(b||a) from full logprob rows, when the caller had them
    near_tie_share: float | None = None
    clean: Metrics | None = None
    # where the first non-finite logprob is: [prompt, position, "engine" | "reference" | "both"] (nonfinite_at)
    first_nonfinite: list | None = None


def _flat(run: LogprobRun, name: str) -> np.ndarray:
    return np.concatenate([np.asarray(getattr(p, name), dtype=np.float64) for p in run.prompts])


def check_same_prompts(*runs: LogprobRun) -> None:
    """Raise ValueError unless every run covers the same prompts with the same token ids."""
    ref = runs[0]
    assert ref.prompts, "a run needs at least one prompt"
    for j, other in enumerate(runs[1:], start=1):
        if len(other.prompts) != len(ref.prompts):
            raise ValueError(
                f"runs are over different prompts: run 0 has {len(ref.prompts)} prompts, "
                f"run {j} has {len(other.prompts)}"
            )
        for i, (p, q) in enumerate(zip(ref.prompts, other.prompts)):
            if p.token_ids.shape != q.token_ids.shape:
                raise ValueError(
                    f"runs are over different prompts: prompt {i} has {p.token_ids.shape[0]} tokens "
                    f"in run 0 and {q.token_ids.shape[0]} in run {j}"
                )
            diff = np.flatnonzero(p.token_ids != q.token_ids)
            if diff.size:
                t = int(diff[0])
                raise ValueError(
                    f"runs are over different prompts: prompt {i} token {t} is {int(p.token_ids[t])} "
                    f"in run 0 and {int(q.token_ids[t])} in run {j}"
                )


def topk_kl_per_position(a_ids: np.ndarray, a_lp: np.ndarray, b_ids: np.ndarray, b_lp: np.ndarray) -> np.ndarray:
    """KL(b||a) per position over the union U of both top-k id sets plus one tail bucket.

    Each run knows its own top-k probabilities exactly; its leftover mass (1 - sum of its top-k) covers everything
    else. An id of U missing from a run's top-k gets an even share of that run's leftover, split with the tail
    bucket (m missing ids -> leftover / (m + 1) each), capped at the run's k-th probability because the id ranked
    below it. What is left of the leftover is the run's tail bucket. So identical top-k gives the exact KL of the
    coarsened distributions, and disjoint top-k sets give a large KL instead of a silent zero.
    """
    pa, pb = np.exp(np.asarray(a_lp, np.float64)), np.exp(np.asarray(b_lp, np.float64))
    eq = np.asarray(a_ids)[:, :, None] == np.asarray(b_ids)[:, None, :]  # (N, ka, kb)
    a_in_b, b_in_a = eq.any(2), eq.any(1)

    def fill(p: np.ndarray, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        leftover = np.clip(1.0 - p.sum(1), 0.0, None)
        m = missing.sum(1)
        each = np.minimum(p.min(1), leftover / (m + 1))
        return each, np.clip(leftover - m * each, 0.0, None)  # per-missing-id share, tail bucket

    fill_a, tail_a = fill(pa, ~b_in_a)
    fill_b, tail_b = fill(pb, ~a_in_b)
    # b's buckets: its own ids (a's probability from a's top-k or a's fill) and a's ids it lacks (b's fill)
    pa_on_b = np.where(b_in_a, np.einsum("nab,na->nb", eq.astype(np.float64), pa), fill_a[:, None])

    def kl_terms(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        return np.where(p > 0, p * (np.log(np.maximum(p, _TINY)) - np.log(np.maximum(q, _TINY))), 0.0)

    a_only = np.where(a_in_b, 0.0, kl_terms(np.broadcast_to(fill_b[:, None], pa.shape), pa))
    return kl_terms(pb, pa_on_b).sum(1) + a_only.sum(1) + kl_terms(tail_b, tail_a)


def full_vocab_kl(a_rows: np.ndarray, b_rows: np.ndarray, chunk: int = 1024) -> float:
    """Mean exact KL(b||a) over positions from full (N, V) logprob rows (log-softmax outputs of both engines).
    Chunked over N so a 32k x 150k pair never needs a float64 copy of the whole thing."""
    a_rows, b_rows = np.asarray(a_rows), np.asarray(b_rows)
    if a_rows.shape != b_rows.shape or a_rows.ndim != 2:
        raise ValueError(
            f"full-vocab KL needs two (N, V) logprob arrays of one shape, got {a_rows.shape} and {b_rows.shape}"
        )
    total = 0.0
    for s in range(0, a_rows.shape[0], chunk):
        la, lb = a_rows[s : s + chunk].astype(np.float64), b_rows[s : s + chunk].astype(np.float64)
        total += float(np.where(np.isneginf(lb), 0.0, np.exp(lb) * (lb - la)).sum())
    return total / a_rows.shape[0]


def near_tie_eps(*dtypes: str) -> float:
    """The tie margin for a comparison of runs in ``dtypes``: the coarsest dtype involved decides what can flip."""
    unknown = [d for d in dtypes if d not in NEAR_TIE_EPS]
    assert dtypes and not unknown, f"near_tie_eps needs dtypes among {sorted(NEAR_TIE_EPS)}, got {dtypes}"
    return max(NEAR_TIE_EPS[d] for d in dtypes)


def near_tie_mask(run: LogprobRun, eps: float) -> np.ndarray | None:
    """Per position: True when some token up to and including that position's last input token had a router
    margin below eps (a routing flip there changes every later hidden state). None when the run has no margins."""
    margins = [p.router_margin for p in run.prompts if p.router_margin is not None]
    if len(margins) < len(run.prompts):
        return None
    # position i sees tokens 0..i, so the running minimum over the first n-1 tokens decides it
    return np.concatenate([np.minimum.accumulate(m.astype(np.float64))[:-1] < eps for m in margins])


def nonfinite_at(a_rows: Sequence[np.ndarray], b_rows: Sequence[np.ndarray]) -> tuple[int, list | None]:
    """The one non-finite rule of prefill and decode verdicts: -> (count of positions where either side's logprob
    is NaN or inf, [row, position, side] of the first such position or None). ``a_rows[i]`` / ``b_rows[i]``: row i's
    logprobs, engine under test (a) and reference (b); side names which run holds it ("engine", "reference",
    "both")."""
    count, first = 0, None
    for i, (a, b) in enumerate(zip(a_rows, b_rows)):
        fa, fb = np.isfinite(np.asarray(a, dtype=np.float64)), np.isfinite(np.asarray(b, dtype=np.float64))
        bad = ~(fa & fb)
        if bad.any():
            count += int(bad.sum())
            if first is None:
                j = int(np.flatnonzero(bad)[0])
                first = [i, j, "both" if not (fa[j] or fb[j]) else "engine" if not fa[j] else "reference"]
    return count, first


def nonfinite_reason(
    count: int,
    total: int,
    first: Sequence | None,
    lane: str | None = None,
    row: str = "prompt",
    position: str = "position",
) -> str:
    """The FAIL reason for ``count`` non-finite logprobs of ``total`` positions: the lane, and the row (prompt or
    sequence) and position of the first, with the side that produced it. ``position`` i of a prompt is the logprob
    of its token i + 1 (PromptLogprobs)."""
    out = f"{count} of {total} positions have a NaN or inf logprob"
    if lane is not None or first is not None:
        out += ":" + (f" lane {lane}" if lane is not None else "")
        if first is not None:
            out += f"{',' if lane is not None else ''} first in {row} {first[0]} at {position} {first[1]} ({first[2]})"
    return out


def _aggregate(d: np.ndarray, nonfinite: np.ndarray, kl: np.ndarray | None, top1: np.ndarray | None) -> Metrics:
    n = d.shape[0]
    if n == 0:
        nan = float("nan")
        return Metrics(
            0,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            nan,
            0,
            None if kl is None else nan,
            None if top1 is None else nan,
        )
    ad = np.abs(d)
    dc = np.clip(d, -K3_CLAMP, K3_CLAMP)
    return Metrics(
        num_positions=n,
        k1=float(np.mean(-d)),
        k2=float(0.5 * np.mean(d * d)),
        k3=float(np.mean(np.exp(-dc) - 1.0 + dc)),
        max_abs=float(np.max(ad)),
        mean_abs=float(np.mean(ad)),
        p99_abs=float(np.percentile(ad, 99)),
        over_0_1=float(np.mean(ad > TAIL_CUTS[0])),
        over_0_5=float(np.mean(ad > TAIL_CUTS[1])),
        over_1_0=float(np.mean(ad > TAIL_CUTS[2])),
        num_nonfinite=int(nonfinite.sum()),
        topk_kl=None if kl is None else float(np.mean(kl)),
        top1_agreement=None if top1 is None else float(np.mean(top1)),
    )


def compare(
    a: LogprobRun,
    b: LogprobRun,
    near_tie_eps: float = NEAR_TIE_EPS["float32"],
    full_rows: tuple[np.ndarray, np.ndarray] | None = None,
) -> Metrics:
    """Metrics of run a (engine under test) against run b (reference) over the same prompts.

    Top-k KL and top-1 agreement need top-k in both runs. ``full_rows`` = (a_rows, b_rows), full (N, V) logprob
    rows in position order, adds the exact KL. Near-ties (router margin below ``near_tie_eps`` in either run, at
    or before the position) are reported as ``near_tie_share`` plus the metrics over the other positions.
    """
    check_same_prompts(a, b)
    la, lb = _flat(a, "logprobs"), _flat(b, "logprobs")
    d = la - lb
    nonfinite = ~(np.isfinite(la) & np.isfinite(lb))
    kl = top1 = None
    if all(p.topk_ids is not None for p in a.prompts + b.prompts):
        a_ids, b_ids = (np.concatenate([p.topk_ids for p in r.prompts]) for r in (a, b))
        kl = topk_kl_per_position(
            a_ids, _flat(a, "topk_logprobs").reshape(a_ids.shape), b_ids, _flat(b, "topk_logprobs").reshape(b_ids.shape)
        )
        top1 = a_ids[:, 0] == b_ids[:, 0]
    out = _aggregate(d, nonfinite, kl, top1)
    if out.num_nonfinite:
        out.first_nonfinite = nonfinite_at([p.logprobs for p in a.prompts], [p.logprobs for p in b.prompts])[1]
    if full_rows is not None:
        if full_rows[0].shape[0] != d.shape[0]:
            raise ValueError(f"full logprob rows have {full_rows[0].shape[0]} positions, the runs {d.shape[0]}")
        out.full_kl = full_vocab_kl(*full_rows)
    masks = [m for m in (near_tie_mask(a, near_tie_eps), near_tie_mask(b, near_tie_eps)) if m is not None]
    if masks:
        flagged = np.logical_or.reduce(masks)
        keep = ~flagged
        out.near_tie_share = float(np.mean(flagged))
        out.clean = _aggregate(
            d[keep], nonfinite[keep], None if kl is None else kl[keep], None if top1 is None else top1[keep]
        )
    return out


DETAIL_MAX_POSITIONS = 2000  # positions per lane kept in verdict JSON for reports: ~25 kB a lane
DETAIL_BINS = 40


def position_detail(
    a: LogprobRun, b: LogprobRun, near_tie_eps: float, max_positions: int = DETAIL_MAX_POSITIONS
) -> dict:
    """What a report draws for one lane: d = a - b along each prompt's positions (4 significant digits) and the
    positions at or after a router near-tie, for prompts in order until ``max_positions`` are listed, plus a
    histogram of d over every finite position (so the histogram is never truncated). ``near_tie_eps`` as given to
    compare()."""
    check_same_prompts(a, b)
    d = _flat(a, "logprobs") - _flat(b, "logprobs")
    masks = [m for m in (near_tie_mask(a, near_tie_eps), near_tie_mask(b, near_tie_eps)) if m is not None]
    flagged = np.logical_or.reduce(masks) if masks else None
    prompts: list[dict[str, Any]] = []
    start = 0
    for i, p in enumerate(a.prompts):
        n = len(p.logprobs)
        take = min(n, max_positions - sum(len(q["d"]) for q in prompts))
        if take <= 0:
            break
        seg = slice(start, start + take)
        prompts.append(
            {
                "prompt": i,
                "d": [float(f"{x:.4g}") for x in d[seg]],
                "near_tie": None if flagged is None else np.flatnonzero(flagged[seg]).tolist(),
            }
        )
        start += n
    finite = d[np.isfinite(d)]
    counts, edges = np.histogram(finite, bins=DETAIL_BINS) if finite.size else (np.zeros(0), np.zeros(0))
    return {
        "num_positions": int(d.size),
        "prompts": prompts,
        "hist": {"edges": [float(f"{x:.4g}") for x in edges], "counts": counts.astype(int).tolist()},
    }


def delta_fidelity(a_lora: LogprobRun, a_base: LogprobRun, b_lora: LogprobRun, b_base: LogprobRun) -> float:
    """||Δa - Δb||₂ / ||Δb||₂ with Δ = logprobs(with adapter) - logprobs(base) per engine: 0 when the engine
    applies the adapter exactly as the reference does, ~1 when it drops it (its output equals the base model)."""
    check_same_prompts(a_lora, a_base, b_lora, b_base)
    da = _flat(a_lora, "logprobs") - _flat(a_base, "logprobs")
    db = _flat(b_lora, "logprobs") - _flat(b_base, "logprobs")
    ref = float(np.linalg.norm(db))
    if ref == 0.0:
        raise ValueError(
            "the reference adapter does not change any logprob (||Δb|| = 0), so delta fidelity is "
            "undefined: its LoRA-B is probably all zeros (PEFT's default init); build the adapter "
            "with init_lora_weights=False and a seed, or fill B"
        )
    return float(np.linalg.norm(da - db)) / ref


def delta_fidelity_by_group(
    groups: Mapping[str, tuple[LogprobRun, LogprobRun]], a_base: LogprobRun, b_base: LogprobRun
) -> dict[str, float]:
    """Delta fidelity per module group (e.g. "attention", "experts", "shared_expert"): each group maps to
    (a_lora, b_lora) runs of an adapter restricted to that group; the base runs are shared. Names the broken part."""
    return {name: delta_fidelity(a_lora, a_base, b_lora, b_base) for name, (a_lora, b_lora) in groups.items()}


def lane_fidelity(
    runs: Mapping[str | None, LogprobRun],
    refs: Mapping[str | None, LogprobRun],
    lane_groups: Mapping[str, Sequence[str]],
) -> dict[str, float | dict[str, float]]:
    """Delta fidelity of every adapter lane of one run (None = the base lane), by module group where the batch
    allows it: a lane whose adapter touches one group is reported as {group: fidelity}; a lane touching several
    gets {"adapter": its own, group: the worst single-group lane of that group, ...} for each of its groups that
    has such a lane (delta_fidelity_by_group), so a verdict names the group an engine dropped instead of only the
    adapter. Lanes without ``lane_groups`` entries, or with nothing to split by, stay one number."""
    single: dict[str, list[str]] = {}
    for name, groups in lane_groups.items():
        if name in runs and len(groups) == 1:
            single.setdefault(groups[0], []).append(name)
    out: dict[str, float | dict[str, float]] = {}
    for lane in runs:
        if lane is None:
            continue
        own = delta_fidelity(runs[lane], runs[None], refs[lane], refs[None])
        groups = tuple(lane_groups.get(lane, ()))
        if len(groups) == 1:
            out[lane] = {groups[0]: own}
            continue
        split = {
            g: max(delta_fidelity_by_group({s: (runs[s], refs[s]) for s in single[g]}, runs[None], refs[None]).values())
            for g in groups
            if g in single
        }
        out[lane] = {"adapter": own, **split} if split else own
    return out
