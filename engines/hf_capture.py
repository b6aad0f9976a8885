"""The hf engine's per-layer capture for ``lpdiff bisect`` (engines.base.CapturesLayers; HFEngine.capture_layers
checks the request and calls ``capture_layers`` here). Hooked in one forward on equal-length prompts: each layer's
token mixer under the name of its kind (``layer_modules``), the MoE's routed experts with their routing, its shared
expert (with Qwen3.5's sigmoid gate), Nemotron-Super's latent projections ("latent": fc1_latent_proj's output then
fc2_latent_proj's, each on its own input) and the layer output; then every module re-runs on the same inputs with the
adapter off ("_base"). The hybrid mixers' sub-steps of the layers ``steps``: engines/hf_steps.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Nemotron-H's block types (config.layers_block_type) as lpdiff bisect names the mixer: its "linear_attention" is a
# Mamba-2 mixer, its "mlp" a dense relu² MLP; "moe" blocks are captured module by module (router, experts, shared)
_NEMOTRON_MIXERS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp"}
LATENT = ("fc1_latent_proj", "fc2_latent_proj")  # Nemotron-Super's MoE: hidden -> latent -> experts -> hidden


@torch.inference_mode()
def capture_layers(engine, prompts: Sequence[Sequence[int]], adapter: str | None, steps: Sequence[int] = ()) -> dict:
    """``engine``: an open HFEngine (request already checked) -> {(layer, point): tensor}."""
    cap: dict = {}
    calls: dict = {}  # (layer, point) -> (module, args, kwargs) to re-run without the adapter
    handles = []
    layers = engine.decoder.layers

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1])

    for i, layer in enumerate(layers):
        mixer, kind, moe = layer_modules(layer)

        def mixer_hook(mod, args, kwargs, out, i=i, kind=kind):
            calls[i, kind] = (mod, args, kwargs)
            h = kwargs.get("hidden_states", args[0] if args else None)
            o = out[0] if isinstance(out, tuple) else out  # attention returns (out, weights), the others out
            cap[i, kind], cap[i, f"{kind}_in"] = flat(o), flat(h)

        def moe_hook(mod, args, kwargs, i=i):
            cap[i, "moe_in"] = flat(kwargs.get("hidden_states", args[0] if args else None))

        def experts_hook(mod, args, out, i=i):
            calls[i, "experts"] = (mod, args, {})
            x, ids, weights = args[:3]
            cap[i, "experts_in"], cap[i, "router_ids"], cap[i, "router_weights"] = x, ids, weights
            cap[i, "experts"] = out

        def latent_hook(mod, args, out, i=i, name=""):
            calls[i, name] = (mod, args, {})
            cap[i, f"{name}_in"], cap[i, name] = flat(args[0]), flat(out)

        def layer_hook(mod, args, out, i=i):
            cap[i, "hidden"] = flat(out[0] if isinstance(out, tuple) else out)

        if mixer is not None:
            handles.append(mixer.register_forward_hook(mixer_hook, with_kwargs=True))
        if moe is not None:
            if _has_shared(moe) or moe is getattr(layer, "mixer", None):  # the shared expert's, Nemotron's router's
                handles.append(moe.register_forward_pre_hook(moe_hook, with_kwargs=True))
            handles.append(moe.experts.register_forward_hook(experts_hook))
            for name in LATENT if has_latent(moe) else ():
                hook = getattr(moe, name).register_forward_hook(lambda m, a, o, i=i, n=name: latent_hook(m, a, o, i, n))
                handles.append(hook)
        handles.append(layer.register_forward_hook(layer_hook))
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=engine.device)
    tracer = _step_tracer(layers, steps, cap, ids.numel())
    try:
        with engine._adapter_ctx(adapter), tracer.active():
            engine.decoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            for i, layer in enumerate(layers):  # the shared expert on its input, adapter on
                moe = layer_modules(layer)[2]
                if moe is not None and (i, "moe_in") in cap and _has_shared(moe):
                    cap[i, "shared_expert_in"] = cap[i, "moe_in"]
                    cap[i, "shared_expert"] = _shared_expert(moe, cap[i, "moe_in"])
    finally:
        for h in handles:
            h.remove()
    tracer.suffix = "_base"
    with engine._adapter_ctx(None), tracer.active():  # the same module inputs through the base weights
        for (i, point), (mod, args, kwargs) in calls.items():
            base = mod(*args, **kwargs)
            cap[i, f"{point}_base"] = flat(base[0] if isinstance(base, tuple) else base)
        for i, layer in enumerate(layers):
            if (i, "shared_expert_in") in cap:
                cap[i, "shared_expert_base"] = _shared_expert(layer_modules(layer)[2], cap[i, "shared_expert_in"])
    for i in range(len(layers)):  # the two latent projections as one module, fc1's columns first
        for suffix in ("", "_base") if (i, LATENT[0]) in cap else ():
            cap[i, "latent" + suffix] = torch.cat([cap.pop((i, n + suffix)) for n in LATENT], dim=-1)
    return cap


def layer_modules(layer) -> tuple:
    """A decoder layer -> (token mixer or None, its capture name, the MoE block holding ``experts`` or None):
    self_attn -> "attention", Qwen3.5's Gated DeltaNet linear_attn -> "linear_attention", Nemotron-H's ``mixer``
    by its block type (_NEMOTRON_MIXERS; a MoE block is the layer's MoE, not its mixer)."""
    mixer = getattr(layer, "self_attn", None)
    kind = "attention"
    if mixer is None and getattr(layer, "linear_attn", None) is not None:
        mixer, kind = layer.linear_attn, "linear_attention"
    moe = getattr(layer, "mlp", None)
    if mixer is None and getattr(layer, "mixer", None) is not None:  # Nemotron-H: one mixer per block
        block = getattr(layer, "block_type", None)
        if block == "moe":
            moe = layer.mixer
        elif block in _NEMOTRON_MIXERS:
            mixer, kind = layer.mixer, _NEMOTRON_MIXERS[block]
        else:
            raise ValueError(f"layer kind {block!r} of this Nemotron-H model has no per-module capture")
    return mixer, kind, (moe if getattr(moe, "experts", None) is not None else None)


def has_latent(moe) -> bool:
    """Nemotron-Super's MoE (moe_latent_size set: Linear projections; otherwise transformers puts Identity there)."""
    return all(not isinstance(getattr(moe, n, torch.nn.Identity()), torch.nn.Identity) for n in LATENT)


def _step_tracer(layers, steps: Sequence[int], cap: dict, tokens: int):
    """engines/hf_steps.py's tracer of the hybrid mixers of layers ``steps`` (other kinds have no sub-steps)."""
    from lpdiff.engines.hf_steps import StepTracer

    mixers = {i: layer_modules(layers[i])[:2] for i in steps}
    return StepTracer({i: mk for i, mk in mixers.items() if mk[1] in ("mamba", "linear_attention")}, cap, tokens)


def _has_shared(moe) -> bool:
    return getattr(moe, "shared_expert", None) is not None or getattr(moe, "shared_experts", None) is not None


def _shared_expert(moe, x: torch.Tensor) -> torch.Tensor:
    """The shared expert's share of the MoE output on ``x`` (tokens, hidden): Qwen3.5's scaled by its sigmoid
    gate (Qwen3_5MoeSparseMoeBlock), Nemotron-H's shared_experts as they are (NemotronHMoE)."""
    if getattr(moe, "shared_experts", None) is not None:
        return moe.shared_experts(x)
    out = moe.shared_expert(x)
    gate = getattr(moe, "shared_expert_gate", None)
    return out if gate is None else torch.sigmoid(gate(x)) * out
