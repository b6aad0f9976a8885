"""``lpdiff calibrate``: thresholds from measured noise floors.

Two implementations that are both correct (HF's eager vs batched expert kernels, bf16 vs fp32, a rerun vs
itself, TP 1 vs TP n) are run over every prompt set and adapter of a model; the worst k2, max |Δ| and LoRA-delta
fidelity seen between them is the noise floor, and ``factor`` times it becomes the threshold that verdicts for
``record_as`` read (harness/pipeline/thresholds.json), with the provenance: noise, factor, date, commit, device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lpdiff.engines import DEFAULT_ENGINE, REFERENCE_ENGINE, capabilities
from lpdiff.harness.pipeline.noise import Noise, fp32_rounding_floor, pair_noise, threshold_from
from lpdiff.harness.pipeline.session import run_session
from lpdiff.harness.pipeline.thresholds import Threshold, record
from lpdiff.harness.spec.resolve import resolve


@dataclass(slots=True)
class Lane:
    engine: str
    dtype: str
    options: dict = field(default_factory=dict)
    tp: int = 1


def measure_noise(
    model: str,
    a: Lane,
    b: Lane,
    prompt_sets=("default", "long"),
    num_layers=None,
    log=print,
    floor: Noise | None = None,
) -> Noise:
    """Verdicts judge near-tie positions apart, so the noise is measured on the clean positions too. With both
    lanes in fp32, ``floor`` (when given) takes the largest fp32 rounding floor of b's runs: two correct kernels
    can agree bit for bit on one CPU and not on another, and a threshold must hold on both."""
    noise = Noise()
    for ps in prompt_sets:
        spec, adapters, prompts = resolve(model, prompts=ps, num_layers=num_layers)
        ra = run_session(a.engine, spec, adapters, prompts, a.dtype, a.tp, 0, a.options).first
        rb = run_session(b.engine, spec, adapters, prompts, b.dtype, b.tp, 0, b.options).first
        for name in ra:
            lane = pair_noise(ra, rb, [name], dtypes=(a.dtype, b.dtype), clean_only=True)
            noise.merge(lane)
            log(f"  {model} [{ps}] {name or 'base'}: {lane.describe()}")
        if floor is not None and a.dtype == b.dtype == "float32":
            f = fp32_rounding_floor(rb, _layers(spec))
            floor.k2, floor.max_abs = max(floor.k2, f.k2), max(floor.max_abs, f.max_abs)
    return noise


def _layers(spec) -> int:
    if spec.num_layers:
        return spec.num_layers
    from lpdiff.harness.spec.catalog import hf_config

    return int(getattr(hf_config(spec), "num_hidden_layers", 1) or 1)


def zoo_threshold(
    noise: Noise, factor: float, a: Lane, b: Lane, fidelity: bool = True, floor: Noise | None = None
) -> Threshold:
    return threshold_from(
        noise,
        factor,
        fidelity=fidelity,
        floor=floor,
        note=f"noise = worst of {noise.comparisons} comparisons ({noise.positions} positions) "
        f"between {_lane(a)} and {_lane(b)}",
    )


def _lane(lane: Lane) -> str:
    return f"{lane.engine}:{lane.dtype}{lane.options or ''}" + (f" at TP {lane.tp}" if lane.tp > 1 else "")


def calibrate(
    model: str,
    a: Lane,
    b: Lane,
    record_as: list[tuple[str, str]],
    factor: float = 10.0,
    fidelity: bool = True,
    tp: int = 1,
    num_layers=None,
    log=print,
) -> Threshold:
    """Measure the a-vs-b noise on ``model`` and record factor x noise for each (engine pair, dtype)."""
    floor = Noise()
    noise = measure_noise(model, a, b, num_layers=num_layers, log=log, floor=floor)
    t = zoo_threshold(noise, factor, a, b, fidelity, floor if floor.k2 > 0 else None)
    for pair, dtype in record_as:
        record(model, pair, dtype, tp, t)
        log(
            f"recorded {model} {pair} {dtype} tp={tp}: k2 {t.k2:.3g} max|d| {t.max_abs:.3g} "
            f"delta-fidelity {t.delta_fidelity if t.delta_fidelity is None else f'{t.delta_fidelity:.3g}'}"
        )
    return t


# The tiny zoo's standard calibration: what each suite lane is judged with, and the correct pair it comes from.
_REF, _OWN = REFERENCE_ENGINE, DEFAULT_ENGINE
ZOO_PLAN = [
    # fp32: the reference's two correct expert kernels (its fp32 twins: HF batched_mm vs eager) bound fp32 rounding
    # between implementations.
    (
        Lane(_REF, "float32", dict(capabilities(_REF).fp32_twins[0])),
        Lane(_REF, "float32", dict(capabilities(_REF).fp32_twins[1])),
        [(f"{_REF}:float32-vs-{_REF}:float32", "float32"), (f"{_OWN}:float32-vs-{_REF}:float32", "float32")],
        30.0,
        True,
    ),
    # bf16: the reference itself in bf16 against fp32. LoRA-delta fidelity is not judged in bf16: its noise on
    # the tiny zoo (0.06-0.24) leaves no room below the 1.0 of a dropped adapter.
    (
        Lane(_REF, "bfloat16"),
        Lane(_REF, "float32"),
        [(f"{_REF}:bfloat16-vs-{_REF}:float32", "bfloat16"), (f"{_OWN}:bfloat16-vs-{_REF}:float32", "bfloat16")],
        10.0,
        False,
    ),
]


def calibrate_zoo(models: list[str], log=print) -> None:
    for model in models:
        for a, b, record_as, factor, fidelity in ZOO_PLAN:
            log(f"calibrating {model}: {a.engine}:{a.dtype} vs {b.engine}:{b.dtype} (x{factor:g})")
            calibrate(model, a, b, record_as, factor, fidelity, log=log)
