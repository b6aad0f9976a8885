"""``lpdiff bisect MODEL [--adapter A] [--fault F]``: where does the triton runtime first leave HF + PEFT?

Both engines see the same prompts. HF is hooked (decoder layers, self_attn, experts with their routing) and every
module of the triton runtime is re-run on HF's own inputs to that module, so each module's error is its own, not
inherited from the layers before it. Per layer, in data-flow order:

  attention_lora  the attention LoRA delta (attention with the adapter minus without), both engines
  attention       self_attn output with the adapter
  router          routing weights scattered to (tokens, experts): wrong experts or wrong weights
  expert_lora     the expert LoRA delta (experts with minus without the adapter) on HF's routing
  experts         the MoE output on HF's routing
  hidden          the layer's output hidden state, each engine running freely (errors accumulate here)

Errors are ||a - b|| / ||b|| relative to the HF module's output (for deltas: the module's full output, so a delta
that should be zero still has a scale). The noise floor comes from two correct implementations, never from the
engine under test (a defect that touches every layer would otherwise be its own floor): HF with its second expert
kernel against HF eager (batched_mm on CPU, grouped_mm on a GPU), the worst relative error of any module in any
layer between them — fp32 rounding between two orderings of the same arithmetic (2-3.4e-7 on the tiny zoo, where
the clean runtime's worst module is 3.3e-7). The first layer + module whose error exceeds ``factor`` x the floor is
named.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lpdiff.engines.base import dense_routing

MODULES = ("attention_lora", "attention", "router", "expert_lora", "experts", "hidden")
FACTOR = 10.0
FLOOR_MIN = 1e-7  # fp32 relative rounding: a bit-exact clean module would otherwise give a zero floor


@dataclass(slots=True)
class Finding:
    layer: int
    module: str
    error: float
    floor: float
    factor: float

    @property
    def ratio(self) -> float:
        return self.error / self.floor


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    den = float(scale.float().norm())
    return float((a.float() - b.float()).norm()) / max(den, 1e-30)


def bisect_prompts(model: str, num_prompts: int = 8) -> list[list[int]]:
    """Equal-length prompts (the shortest of the default set), so HF's batch needs no padding and its flattened
    tokens are the triton runtime's packed order."""
    from lpdiff.harness.spec.prompts import prompt_set

    prompts = prompt_set(model, "default")[:num_prompts]
    n = min(len(p) for p in prompts)
    return [p[:n] for p in prompts]


def hf_capture(spec, adapters, adapter: str, prompts, options: dict | None = None) -> dict:
    """HF's per-layer module inputs and outputs, with and without the adapter, on ``prompts`` (fp32)."""
    from lpdiff.engines import EngineConfig, open_engine

    opts = {"router_margins": False, **(options or {})}
    with open_engine("hf", EngineConfig(model=spec, adapters=adapters, options=opts)) as eng:
        return eng.capture_layers(prompts, adapter)


def reference_floor(spec, adapters, adapter: str, prompts, reference: dict) -> dict[str, float]:
    """The noise floor of every module kind: the worst module error between HF's two correct expert kernels
    (``reference`` is the eager capture), floored at FLOOR_MIN."""
    from lpdiff.harness.pipeline.noise import noise_pair

    (_, other), _ = noise_pair("hf", "float32")
    pair = module_errors(hf_capture(spec, adapters, adapter, prompts, other), reference)
    worst = max([FLOOR_MIN] + [e for e in pair.values() if e == e])  # NaN would be a bug in HF itself: ignore
    return {mod: worst for mod in MODULES}


def triton_errors(spec, adapters, adapter: str, prompts, hf: dict, fault: str | None) -> dict[tuple[int, str], float]:
    """Each triton module re-run on HF's inputs to it (fp32, TP 1) -> relative error per (layer, module)."""
    from lpdiff.engines import EngineConfig, open_engine

    opts = {"fault": fault} if fault else {}
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters, options=opts)) as eng:
        got = eng.capture_layers(prompts, adapter, inputs=hf)
    return module_errors(got, hf)


def module_errors(got: dict, ref: dict) -> dict[tuple[int, str], float]:
    """Two engines' captures -> relative error per (layer, MODULES entry); deltas are scaled by the reference
    module's full output, so a delta that should be zero still has a scale."""
    err: dict[tuple[int, str], float] = {}
    for i in sorted({i for i, _ in got}):
        for mod, delta in (("attention", "attention_lora"), ("experts", "expert_lora")):
            out, base, r, r_base = got[i, mod], got[i, f"{mod}_base"], ref[i, mod], ref[i, f"{mod}_base"]
            err[i, delta] = _rel(out - base, r - r_base, r)
            err[i, mod] = _rel(out, r, r)
        ids, ref_ids = got[i, "router_ids"], ref[i, "router_ids"]
        width = 1 + max(int(ids.max()), int(ref_ids.max()))  # the same width for both: the error is unchanged by it
        dense = dense_routing(ids, got[i, "router_weights"], width)
        dense_ref = dense_routing(ref_ids, ref[i, "router_weights"], width)
        err[i, "router"] = _rel(dense, dense_ref, dense_ref)
        err[i, "hidden"] = _rel(got[i, "hidden"], ref[i, "hidden"], ref[i, "hidden"])
    return err


def first_above(errors: dict[tuple[int, str], float], floors: dict[str, float], factor: float) -> Finding | None:
    for layer in sorted({i for i, _ in errors}):
        for mod in MODULES:
            e = errors.get((layer, mod))
            if e is not None and not e <= factor * floors[mod]:  # NaN counts as above
                return Finding(layer, mod, e, floors[mod], factor)
    return None


@dataclass(slots=True)
class BisectResult:
    model: str
    adapter: str
    fault: str | None
    errors: dict
    floors: dict
    factor: float
    finding: Finding | None

    def table(self) -> str:
        layers = sorted({i for i, _ in self.errors})
        head = "layer  " + "  ".join(f"{m:>14}" for m in MODULES)
        rows = ["noise  " + "  ".join(f"{self.floors[m]:>14.3g}" for m in MODULES), head]
        for i in layers:
            cells = []
            for m in MODULES:
                e = self.errors[i, m]
                mark = "*" if not e <= self.factor * self.floors[m] else " "
                cells.append(f"{e:>13.3g}{mark}")
            rows.append(f"{i:>5}  " + "  ".join(cells))
        return "\n".join(rows)

    def summary(self) -> str:
        f = self.finding
        what = f"fault {self.fault}" if self.fault else "the runtime"
        if f is None:
            return f"{self.model} [{self.adapter}] {what}: every module within {self.factor:g}x its noise floor"
        return (f"{self.model} [{self.adapter}] {what}: first above noise: layer {f.layer} {f.module} "
                f"(error {f.error:.3g} = {f.ratio:.3g}x its floor {f.floor:.3g}; limit {f.factor:g}x)")


def bisect(model: str, adapter: str | None = None, fault: str | None = None, factor: float = FACTOR,
           num_prompts: int = 8) -> BisectResult:
    from lpdiff.harness.spec.resolve import resolve

    spec, adapters, _ = resolve(model)
    if not adapters:
        raise ValueError(f"model {model!r} has no zoo adapters to bisect")
    if adapter is None:
        adapter = "experts" if "experts" in adapters else next(iter(adapters))
    if adapter not in adapters:
        raise KeyError(f"model {model!r} has no adapter {adapter!r}; available: {sorted(adapters)}")
    prompts = bisect_prompts(model, num_prompts)
    hf = hf_capture(spec, adapters, adapter, prompts, {"experts_impl": "eager"})
    floors = reference_floor(spec, adapters, adapter, prompts, hf)
    errors = triton_errors(spec, adapters, adapter, prompts, hf, fault)
    return BisectResult(model, adapter, fault, errors, floors, factor, first_above(errors, floors, factor))
