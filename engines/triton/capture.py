"""Per-layer capture for lpdiff bisect (engines.base.CapturesLayers): each module of the runtime re-run on another
engine's inputs to that module, so that a module's error is its own and not inherited from the layers before."""
from __future__ import annotations

from typing import Sequence

import torch

from lpdiff.engines.base import check_request
from lpdiff.engines.triton.batch import Batch
from lpdiff.engines.triton.moe import experts, route


@torch.inference_mode()
def capture_layers(engine, prompts: Sequence[Sequence[int]], adapter: str | None = None,
                   inputs: dict | None = None) -> dict[tuple[int, str], torch.Tensor]:
    """``engine``: an open TritonEngine at TP 1. -> {(layer, point): tensor}: "hidden" from the runtime's own
    forward; with ``inputs`` (e.g. the hf engine's capture) also attention and experts with and without the
    adapter, and the routing, each computed on that capture's inputs to the module."""
    rt = engine.runtime
    if rt is None:
        raise RuntimeError("use the engine as a context manager: `with open_engine('triton', cfg) as eng:`")
    if engine.workers is not None:
        raise ValueError("capture_layers runs at tp=1 (a module's output under TP is a shard)")
    check_request(prompts, adapter, engine.config.adapters)
    m, cfg = rt.model, rt.cfg
    batch = Batch.build([list(map(int, p)) for p in prompts], [rt.slot(adapter)] * len(prompts), cfg, rt.dtype,
                        rt.device)
    m.capture = {}
    try:
        m.forward(batch)
        free = m.capture
    finally:
        m.capture = None
    cap: dict = {(i, "hidden"): h for i, h in free.items()}
    if inputs is None:
        return cap
    for i, lw in enumerate(m.w.layers):
        ll = m.lora.layers[i] if m.lora is not None else None
        h = inputs[i, "attention_in"].to(rt.dtype)
        cap[i, "attention"] = m.attend(h, lw, ll, batch, cfg.sliding_windows[i])
        cap[i, "attention_base"] = m.attend(h, lw, None, batch, cfg.sliding_windows[i])
        x, ids, weights = inputs[i, "experts_in"], inputs[i, "router_ids"], inputs[i, "router_weights"]
        own_ids, own_weights, _ = route(x, lw, cfg, m.impl)
        cap[i, "router_ids"], cap[i, "router_weights"] = own_ids, own_weights
        w32 = weights.float()
        cap[i, "experts"] = experts(x, ids, w32, lw, cfg, ll.moe if ll is not None else None, batch.token_adapter,
                                    m.impl)
        cap[i, "experts_base"] = experts(x, ids, w32, lw, cfg, None, None, m.impl)
    return cap
