"""The train/rollout mismatch metrics RL users monitor, over decoded tokens: the engine samples (rollout policy,
logprob a) and the reference scores the same sequence by prefill (trainer policy, logprob b).

Per generated token, the log-ratio r = b - a = log(pi_train / pi_rollout) (tokens are drawn from the rollout, so
these estimate KL(rollout || train)):
  k1           mean of -r (an unbiased KL estimate, can be negative)
  k3           mean of exp(r) - 1 - r with r clamped to [-10, 10] first, as miles does (metrics.K3_CLAMP), so that
               one wild token cannot overflow it (verl rollout_corr, prime-rl mismatch_kl, miles train_rollout_kl)
  seq_k3_mean  mean over sequences of each sequence's mean k3; seq_k3_max its largest (one bad rollout stands out)
  outside_band share of tokens whose ratio exp(r) lies outside [0.5, 2] (IcePop masks those tokens)
beside lpdiff's own k2 (mean r^2 / 2), max |d| and mean |d| (d = a - b). A non-finite logprob on either side is
counted (``num_nonfinite``) and left out of the other aggregates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lpdiff.harness.pipeline.metrics import K3_CLAMP, nonfinite_at

BAND = (0.5, 2.0)  # IcePop's ratio band


@dataclass(slots=True)
class DecodeMetrics:
    num_tokens: int
    num_sequences: int
    k1: float
    k3: float
    seq_k3_mean: float
    seq_k3_max: float
    outside_band: float
    k2: float
    max_abs: float
    mean_abs: float
    num_nonfinite: int
    first_nonfinite: list | None = None  # [sequence, generated position, side] of the first one (nonfinite_at)


def token_k3(log_ratio: np.ndarray) -> np.ndarray:
    r = np.clip(log_ratio, -K3_CLAMP, K3_CLAMP)
    return np.exp(r) - 1.0 - r


def decode_metrics(engine: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> DecodeMetrics:
    """``engine[i]`` / ``reference[i]``: the logprobs of sequence i's generated tokens, engine's own (decode) and
    the reference's (prefill of prompt + generated), same length per sequence."""
    if len(engine) != len(reference):
        raise ValueError(f"{len(engine)} engine sequences against {len(reference)} reference sequences")
    rs, per_seq = [], []
    for i, (a, b) in enumerate(zip(engine, reference)):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: {a.shape[0]} engine logprobs against {b.shape[0]} reference logprobs")
        finite = np.isfinite(a) & np.isfinite(b)
        r = (b - a)[finite]
        rs.append(r)
        if r.size:
            per_seq.append(float(token_k3(r).mean()))
    bad, first = nonfinite_at(engine, reference)  # the prefill verdicts' rule (metrics.nonfinite_at)
    r = np.concatenate(rs) if rs else np.zeros(0)
    if r.size == 0:
        nan = math.nan
        return DecodeMetrics(0, len(engine), nan, nan, nan, nan, nan, nan, nan, nan, bad, first)
    ratio = np.exp(np.clip(r, -K3_CLAMP, K3_CLAMP))
    return DecodeMetrics(
        num_tokens=int(r.size),
        num_sequences=len(engine),
        k1=float(np.mean(-r)),
        k3=float(token_k3(r).mean()),
        seq_k3_mean=float(np.mean(per_seq)),
        seq_k3_max=float(np.max(per_seq)),
        outside_band=float(np.mean((ratio < BAND[0]) | (ratio > BAND[1]))),
        k2=float(0.5 * np.mean(r * r)),
        max_abs=float(np.max(np.abs(r))),
        mean_abs=float(np.mean(np.abs(r))),
        num_nonfinite=bad,
        first_nonfinite=first,
    )
