"""Routing capture for the triton runtime (engine option ``capture_routing``): each prompt's expert ids, top-k
weights and top-k margin per MoE layer, as ``PromptLogprobs.routed_*``. The forward runs eagerly while capturing
(a CUDA graph replay would not run the Python that collects the per-layer tensors); routing is replicated on every
TP rank, so rank 0's copy is the engine's."""
from __future__ import annotations

import dataclasses

import torch

from lpdiff.harness.types import PromptLogprobs


def supports_routing(runtime) -> bool:
    """The decoder collects routing (MoeTransformer); the hybrids' own model classes do not yet."""
    return hasattr(runtime.model, "routing")


def run_with_routing(runtime, prompts: list[list[int]], slots: list[int], top_k: int) -> list[PromptLogprobs] | None:
    """Runtime.run with the decoder recording routing, which is then cut into each prompt's (n, L, K) arrays
    (prompts are packed in order, so each prompt's tokens are the next n rows)."""
    model = runtime.model
    graphs, runtime.graphs = runtime.graphs, None
    model.routing = []
    try:
        out = runtime.run(prompts, slots, top_k)
        layers = model.routing
    finally:
        model.routing, runtime.graphs = None, graphs
    if out is None:
        return None
    ids = torch.stack([r[0] for r in layers], dim=1).to(torch.int32).cpu().numpy()
    weights = torch.stack([r[1] for r in layers], dim=1).float().cpu().numpy()
    margins = torch.stack([r[2] for r in layers], dim=1).float().cpu().numpy()
    res, tok = [], 0
    for p in out:
        n = p.token_ids.shape[0]
        res.append(dataclasses.replace(p, routed_experts=ids[tok:tok + n], routed_weights=weights[tok:tok + n],
                                       routed_margins=margins[tok:tok + n]))
        tok += n
    assert tok == ids.shape[0], f"routing rows {ids.shape[0]} for {tok} packed tokens"
    return res
