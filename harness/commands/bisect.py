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
that should be zero still has a scale). The noise floor of each module kind is the worst error of the clean
runtime over all layers; the first layer + module whose error exceeds ``factor`` x its floor is named.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

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


def _dense_routing(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], num_experts).scatter_(1, ids.long().cpu(), weights.float().cpu())


def bisect_prompts(model: str, num_prompts: int = 8) -> list[list[int]]:
    """Equal-length prompts (the shortest of the default set), so HF's batch needs no padding and its flattened
    tokens are the triton runtime's packed order."""
    from lpdiff.harness.spec.prompts import prompt_set

    prompts = prompt_set(model, "default")[:num_prompts]
    n = min(len(p) for p in prompts)
    return [p[:n] for p in prompts]


def hf_capture(spec, adapters, adapter: str, prompts) -> dict:
    """HF's per-layer module inputs and outputs (with and without the adapter) on ``prompts`` (fp32)."""
    from lpdiff.engines import EngineConfig, open_engine

    cap: dict = {}
    with open_engine("hf", EngineConfig(model=spec, adapters=adapters, options={"router_margins": False})) as eng:
        peft_model = eng.model
        peft_model.set_adapter(eng.peft_names[adapter])
        handles = []
        for i, layer in enumerate(eng.decoder.layers):
            def attn_hook(mod, args, kwargs, out, i=i):
                cap[i, "attn_call"] = (args, kwargs)
                cap[i, "attention"] = out[0].reshape(-1, out[0].shape[-1])
                cap[i, "attn_in"] = (kwargs.get("hidden_states", args[0] if args else None)).reshape(
                    -1, out[0].shape[-1])

            def experts_hook(mod, args, out, i=i):
                cap[i, "experts_call"] = args
                cap[i, "experts"] = out

            def layer_hook(mod, args, out, i=i):
                h = out[0] if isinstance(out, tuple) else out
                cap[i, "hidden"] = h.reshape(-1, h.shape[-1])

            handles += [layer.self_attn.register_forward_hook(attn_hook, with_kwargs=True),
                        layer.mlp.experts.register_forward_hook(experts_hook),
                        layer.register_forward_hook(layer_hook)]
        ids = torch.tensor(prompts, dtype=torch.long, device=eng.device)
        with torch.inference_mode():
            eng.decoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            for h in handles:
                h.remove()
            with peft_model.disable_adapter():  # the same module inputs through the base weights
                for i, layer in enumerate(eng.decoder.layers):
                    args, kwargs = cap[i, "attn_call"]
                    base = layer.self_attn(*args, **kwargs)[0]
                    cap[i, "attention_base"] = base.reshape(-1, base.shape[-1])
                    cap[i, "experts_base"] = layer.mlp.experts(*cap[i, "experts_call"])
    return cap


def triton_errors(spec, adapters, adapter: str, prompts, hf: dict, fault: str | None) -> dict[tuple[int, str], float]:
    """Each triton module re-run on HF's inputs to it (fp32, TP 1) -> relative error per (layer, module)."""
    from lpdiff.engines import EngineConfig, open_engine
    from lpdiff.engines.triton.batch import Batch
    from lpdiff.engines.triton.moe import experts, route

    opts = {"fault": fault} if fault else {}
    err: dict[tuple[int, str], float] = {}
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters, options=opts)) as eng:
        rt = eng.runtime
        m, cfg = rt.model, rt.cfg
        slot = rt.slot(adapter)
        batch = Batch.build(prompts, [slot] * len(prompts), cfg, rt.dtype, rt.device)
        m.capture = {}
        try:
            m.forward(batch)
            free = m.capture
        finally:
            m.capture = None
        with torch.inference_mode():
            for i, lw in enumerate(m.w.layers):
                ll = m.lora.layers[i] if m.lora is not None else None
                window = cfg.sliding_windows[i]
                h_attn = hf[i, "attn_in"].to(rt.dtype)
                att = m.attend(h_attn, lw, ll, batch, window)
                att_base = m.attend(h_attn, lw, None, batch, window)
                ref, ref_base = hf[i, "attention"], hf[i, "attention_base"]
                err[i, "attention_lora"] = _rel(att - att_base, ref - ref_base, ref)
                err[i, "attention"] = _rel(att, ref, ref)
                x, ids, weights = hf[i, "experts_call"]
                t_ids, t_w, _ = route(x, lw, cfg, m.impl)
                dense_ref = _dense_routing(ids, weights, cfg.num_experts)
                err[i, "router"] = _rel(_dense_routing(t_ids, t_w, cfg.num_experts), dense_ref, dense_ref)
                w32 = weights.float()
                ex = experts(x, ids, w32, lw, cfg, ll.moe if ll is not None else None, batch.token_adapter, m.impl)
                ex_base = experts(x, ids, w32, lw, cfg, None, None, m.impl)
                ref, ref_base = hf[i, "experts"], hf[i, "experts_base"]
                err[i, "expert_lora"] = _rel(ex - ex_base, ref - ref_base, ref)
                err[i, "experts"] = _rel(ex, ref, ref)
                err[i, "hidden"] = _rel(free[i], hf[i, "hidden"], hf[i, "hidden"])
    return err


def noise_floors(clean: dict[tuple[int, str], float]) -> dict[str, float]:
    return {mod: max([FLOOR_MIN] + [e for (_, m), e in clean.items() if m == mod]) for mod in MODULES}


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
    from lpdiff.harness.pipeline.job import Job, resolve

    spec, adapters, _ = resolve(Job(model=model))
    if not adapters:
        raise ValueError(f"model {model!r} has no zoo adapters to bisect")
    if adapter is None:
        adapter = "experts" if "experts" in adapters else next(iter(adapters))
    if adapter not in adapters:
        raise KeyError(f"model {model!r} has no adapter {adapter!r}; available: {sorted(adapters)}")
    prompts = bisect_prompts(model, num_prompts)
    hf = hf_capture(spec, adapters, adapter, prompts)
    clean = triton_errors(spec, adapters, adapter, prompts, hf, None)
    floors = noise_floors(clean)
    errors = clean if fault is None else triton_errors(spec, adapters, adapter, prompts, hf, fault)
    return BisectResult(model, adapter, fault, errors, floors, factor, first_above(errors, floors, factor))


def main(argv: list[str] | None = None) -> int:
    from lpdiff.kernels.faults import runtime_faults

    p = argparse.ArgumentParser(prog="lpdiff bisect", description=__doc__.splitlines()[0])
    p.add_argument("model", help="catalog model the triton runtime supports (e.g. tiny-qwen3-moe, tiny-gpt-oss)")
    p.add_argument("--adapter", default=None, help="zoo adapter run by both engines (default: experts)")
    p.add_argument("--fault", default=None, choices=runtime_faults(),
                   help="bug-zoo fault injected into the triton runtime")
    p.add_argument("--factor", type=float, default=FACTOR, help="how far above its noise floor a module must be")
    p.add_argument("--num-prompts", type=int, default=8)
    args = p.parse_args(argv)
    res = bisect(args.model, args.adapter, args.fault, args.factor, args.num_prompts)
    print(res.table())
    print(res.summary())
    return 1 if res.finding else 0


if __name__ == "__main__":
    sys.exit(main())
