"""``lpdiff calibrate``: thresholds from measured noise floors.

Two implementations that are both correct (HF's eager vs batched expert kernels, bf16 vs fp32, a rerun vs
itself, TP 1 vs TP n) are run over every prompt set and adapter of a model; the worst k2, max |Δ| and LoRA-delta
fidelity seen between them is the noise floor, and ``factor`` times it becomes the threshold that verdicts for
``record_as`` read (harness/thresholds.json), with the provenance: noise, factor, date, commit, device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lpdiff.harness.pipeline.job import Job, resolve, run_engine
from lpdiff.harness.pipeline.provenance import device_name, git_commit
from lpdiff.harness.pipeline.metrics import compare, delta_fidelity
from lpdiff.harness.spec.routing import near_tie_eps
from lpdiff.harness.pipeline.thresholds import Threshold, from_noise, record


@dataclass(slots=True)
class Lane:
    engine: str
    dtype: str
    options: dict = field(default_factory=dict)
    tp: int = 1


@dataclass(slots=True)
class Noise:
    k2: float = 0.0
    max_abs: float = 0.0
    delta_fidelity: float = 0.0
    positions: int = 0
    runs: int = 0

    def add(self, k2: float, max_abs: float, fid: float | None, positions: int) -> None:
        self.k2, self.max_abs = max(self.k2, k2), max(self.max_abs, max_abs)
        if fid is not None:
            self.delta_fidelity = max(self.delta_fidelity, fid)
        self.positions += positions
        self.runs += 1


def measure_noise(model: str, a: Lane, b: Lane, prompt_sets=("default", "long"), num_layers=None,
                  log=print) -> Noise:
    noise = Noise()
    for ps in prompt_sets:
        spec, adapters, prompts = resolve(Job(model=model, prompt_set=ps, num_layers=num_layers))
        ra = run_engine(a.engine, spec, adapters, prompts, a.dtype, a.tp, 0, a.options)
        rb = run_engine(b.engine, spec, adapters, prompts, b.dtype, b.tp, 0, b.options)
        eps = near_tie_eps(a.dtype, b.dtype)
        for name in ra:
            m = compare(ra[name], rb[name], near_tie_eps=eps)
            m = m.clean if m.clean is not None else m  # verdicts judge near-tie positions apart, so must noise
            fid = None if name is None else delta_fidelity(ra[name], ra[None], rb[name], rb[None])
            noise.add(m.k2, m.max_abs, fid, m.num_positions)
            log(f"  {model} [{ps}] {name or 'base'}: k2 {m.k2:.3g} max|d| {m.max_abs:.3g}"
                + ("" if fid is None else f" delta-fidelity {fid:.3g}"))
    return noise


def threshold_from(noise: Noise, factor: float, a: Lane, b: Lane, fidelity: bool = True) -> Threshold:
    # A noise of exactly 0 (bit-identical implementations) would give a zero threshold that fails on any other
    # machine's rounding: floor it at one fp32 ulp-scale difference.
    k2, mx = max(noise.k2, 1e-14), max(noise.max_abs, 1e-6)
    return from_noise(k2, mx, factor, noise_delta_fidelity=max(noise.delta_fidelity, 1e-6) if fidelity else None,
                      gpu=device_name(), commit=git_commit(),
                      note=f"noise = worst of {noise.runs} runs ({noise.positions} positions) between "
                           f"{a.engine}:{a.dtype}{a.options or ''} and {b.engine}:{b.dtype}{b.options or ''}")


def calibrate(model: str, a: Lane, b: Lane, record_as: list[tuple[str, str]], factor: float = 10.0,
              fidelity: bool = True, tp: int = 1, num_layers=None, log=print) -> Threshold:
    """Measure the a-vs-b noise on ``model`` and record factor x noise for each (engine pair, dtype)."""
    noise = measure_noise(model, a, b, num_layers=num_layers, log=log)
    t = threshold_from(noise, factor, a, b, fidelity)
    for pair, dtype in record_as:
        record(model, pair, dtype, tp, t)
        log(f"recorded {model} {pair} {dtype} tp={tp}: k2 {t.k2:.3g} max|d| {t.max_abs:.3g} "
            f"delta-fidelity {t.delta_fidelity if t.delta_fidelity is None else f'{t.delta_fidelity:.3g}'}")
    return t


# The tiny zoo's standard calibration: what each suite lane is judged with, and the correct pair it comes from.
ZOO_PLAN = [
    # fp32: two correct expert kernels (HF eager vs batched_mm) bound fp32 rounding between implementations.
    (Lane("hf", "float32", {"experts_impl": "batched_mm"}), Lane("hf", "float32", {"experts_impl": "eager"}),
     [("hf:float32-vs-hf:float32", "float32"), ("triton:float32-vs-hf:float32", "float32")], 30.0, True),
    # bf16: the reference itself in bf16 against fp32. LoRA-delta fidelity is not judged in bf16: its noise on
    # the tiny zoo (0.06-0.24) leaves no room below the 1.0 of a dropped adapter.
    (Lane("hf", "bfloat16"), Lane("hf", "float32"),
     [("hf:bfloat16-vs-hf:float32", "bfloat16"), ("triton:bfloat16-vs-hf:float32", "bfloat16")], 10.0, False),
]


def calibrate_zoo(models: list[str], log=print) -> None:
    for model in models:
        for a, b, record_as, factor, fidelity in ZOO_PLAN:
            log(f"calibrating {model}: {a.engine}:{a.dtype} vs {b.engine}:{b.dtype} (x{factor:g})")
            calibrate(model, a, b, record_as, factor, fidelity, log=log)
