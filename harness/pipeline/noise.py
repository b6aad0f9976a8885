"""Noise: the worst k2, max |Δ| and LoRA-delta fidelity seen between runs that are all correct (two correct
implementations, bf16 against fp32, an engine against its own rerun). Thresholds are a factor times this."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lpdiff.harness.pipeline.metrics import compare, delta_fidelity, near_tie_eps
from lpdiff.harness.pipeline.session import Lanes

REFERENCE_DTYPE = "float32"  # references are computed in fp32: no engine's bf16 rounding is trusted as truth


def noise_pair(reference: str, dtype: str) -> tuple[tuple[str, dict], tuple[str, dict]]:
    """Two correct runs of the reference, each (dtype, options), whose difference is the reference noise for an
    engine under test in ``dtype``: bf16 -> the reference in bf16 vs fp32; fp32 -> two correct kernels."""
    import torch

    from lpdiff.engines import capabilities

    if dtype != REFERENCE_DTYPE:
        return (dtype, {}), (REFERENCE_DTYPE, {})
    a, b = capabilities(reference).twins(torch.cuda.is_available())  # the engine's two correct fp32 runs
    return ("float32", a), ("float32", b)


@dataclass(slots=True)
class Noise:
    k2: float = 0.0
    max_abs: float = 0.0
    fidelity: float = 0.0
    positions: int = 0
    comparisons: int = 0

    def add(self, k2: float, max_abs: float, fidelity: float | None = None, positions: int = 0) -> Noise:
        self.k2, self.max_abs = max(self.k2, k2), max(self.max_abs, max_abs)
        if fidelity is not None:
            self.fidelity = max(self.fidelity, fidelity)
        self.positions += positions
        self.comparisons += 1
        return self

    def merge(self, *others: Noise) -> Noise:
        for o in others:
            self.k2, self.max_abs = max(self.k2, o.k2), max(self.max_abs, o.max_abs)
            self.fidelity = max(self.fidelity, o.fidelity)
            self.positions += o.positions
            self.comparisons += o.comparisons
        return self

    def describe(self) -> str:
        return f"k2 {self.k2:.3g}, max {self.max_abs:.3g}, fidelity {self.fidelity:.3g}"


def pair_noise(
    a: Lanes,
    b: Lanes,
    lanes: Iterable[str | None] | None = None,
    *,
    dtypes: Sequence[str] = (),
    clean_only: bool = False,
    into: Noise | None = None,
) -> Noise:
    """Noise between runs ``a`` and ``b`` of two correct implementations over the base and each adapter lane.
    ``clean_only``: measure on positions before any router near-tie (for verdicts that judge those apart); the
    near-tie margin comes from ``dtypes`` (the coarsest decides)."""
    noise = into if into is not None else Noise()
    eps = near_tie_eps(*dtypes) if dtypes else near_tie_eps("float32")
    for lane in a if lanes is None else lanes:
        m = compare(a[lane], b[lane], near_tie_eps=eps)
        if clean_only and m.clean is not None:
            m = m.clean
        fid = None
        # b's adapter may change nothing (a fault that drops it): no fidelity to measure then (ValueError)
        with contextlib.suppress(ValueError):
            fid = None if lane is None else delta_fidelity(a[lane], a[None], b[lane], b[None])
        noise.add(m.k2, m.max_abs, fid, m.num_positions)
    return noise


def rerun_noise(runs: Sequence[Lanes]) -> Noise:
    """An engine against its own first pass, over every later pass of the same mixed batch."""
    noise = Noise()
    for later in runs[1:]:
        pair_noise(later, runs[0], into=noise)
    return noise


def fp32_rounding_floor(runs: Lanes, layers: int) -> Noise:
    """The noise two correct fp32 engines show from rounding alone, from the reference's own logprobs: a floor
    for a measured noise that can be 0 on one CPU and not on another (HF's eager and batched_mm expert kernels
    agreed bit for bit on one CPU, so check's fp32 threshold fell to 30 x 1e-14 = 3e-13 in k2 while triton
    against HF measured 1.9e-12 there).

    Model: the ``layers`` decoder layers and the final log-softmax each round a logprob's path once, independently,
    so two engines that sum in different orders differ per position by d with rms sqrt(layers + 1) ulp(lp), ulp
    the fp32 spacing at that logprob (2^-20 = 9.5e-7 for |lp| in [8, 16), 2^-19 in [16, 32): it grows with the
    vocabulary, log V, and with how unlikely the tokens are). Floor: k2 = 0.5 (layers + 1) mean(ulp^2), max |d| =
    4 rms (the largest of ~1000 such draws). On check's tiny-qwen3-moe case at 2 layers (|lp| 2.5 to 39, 41% of
    them >= 16) that is k2 3.3e-12 and max 1.0e-5, against measured triton-vs-HF k2 2.2e-12 (3.6e-12 under
    ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41) and max 7.6e-6, HF batched_mm-vs-eager k2 2.1e-12 (2.3e-12)
    where they differ; check's fp32 factor 30 puts the thresholds at k2 9.9e-11 and max 3e-4, 28x and 40x above
    what two correct engines showed."""
    import numpy as np

    lp = np.concatenate(
        [np.asarray(p.logprobs, dtype=np.float32).ravel() for run in runs.values() for p in run.prompts]
        or [np.zeros(0, np.float32)]
    )
    ulp = np.spacing(np.abs(lp[np.isfinite(lp)])).astype(np.float64)
    if ulp.size == 0:
        return Noise()
    rms = float(np.sqrt((max(layers, 1) + 1) * np.mean(ulp**2)))
    return Noise(k2=0.5 * rms**2, max_abs=4 * rms, positions=int(ulp.size))


def threshold_from(noise: Noise, factor: float, note: str, fidelity: bool = True, floor: Noise | None = None):
    """``factor`` x the noise as a Threshold with its provenance. A noise of exactly 0 (bit-identical
    implementations) would give a zero threshold that fails on any other machine's rounding: it is floored at
    ``floor`` (fp32_rounding_floor for fp32 runs) or else an fp32 ulp-scale difference (k2 1e-14, max |Δ| 1e-6,
    fidelity 1e-6); the note says when the floor decided."""
    from lpdiff.harness.pipeline.provenance import device_name, git_commit
    from lpdiff.harness.pipeline.thresholds import from_noise

    k2_floor, max_floor = (max(floor.k2, 1e-14), max(floor.max_abs, 1e-6)) if floor is not None else (1e-14, 1e-6)
    if noise.k2 < k2_floor or noise.max_abs < max_floor:
        note += f"; floored at fp32 rounding (k2 {k2_floor:.3g}, max |Δ| {max_floor:.3g})"
    return from_noise(
        max(noise.k2, k2_floor),
        max(noise.max_abs, max_floor),
        factor,
        noise_delta_fidelity=max(noise.fidelity, 1e-6) if fidelity else None,
        gpu=device_name(),
        commit=git_commit(),
        note=note,
    )
