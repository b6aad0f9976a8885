"""Routing capture for the triton runtime (engine option ``capture_routing``): each prompt's expert ids, top-k
weights and top-k margin per MoE layer, as ``PromptLogprobs.routed_*``. Every router of the runtime's archs reports
through ``moe.record`` (``moe.route``; Nemotron-H's own sigmoid router); a call runs eagerly while capturing (a CUDA
graph replay would not run the Python that collects the per-layer tensors). Routing is replicated on every TP rank,
so rank 0's copy is the engine's; the workers record nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lpdiff.engines.triton import moe
from lpdiff.harness.types import PromptLogprobs


def run_with_routing(
    runtime, prompts: Sequence[Sequence[int]], slots: list[int], top_k: int
) -> list[PromptLogprobs] | None:
    """Runtime.run with the routers recording, their rows then cut into each prompt's (n, L, K) arrays (prompts
    are packed in order, so each prompt's tokens are the next n rows)."""
    graphs, runtime.graphs = runtime.graphs, None
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    moe.recording = layers
    try:
        out = runtime.run(prompts, slots, top_k)
    finally:
        moe.recording, runtime.graphs = None, graphs
    if out is None:
        return None
    ids = torch.stack([r[0] for r in layers], dim=1).to(torch.int32).cpu().numpy()
    weights = torch.stack([r[1] for r in layers], dim=1).float().cpu().numpy()
    margins = torch.stack([r[2] for r in layers], dim=1).float().cpu().numpy()
    res, tok = [], 0
    for p in out:
        n = p.token_ids.shape[0]
        res.append(
            dataclasses.replace(
                p,
                routed_experts=ids[tok : tok + n],
                routed_weights=weights[tok : tok + n],
                routed_margins=margins[tok : tok + n],
            )
        )
        tok += n
    assert tok == ids.shape[0], f"routing rows {ids.shape[0]} for {tok} packed tokens"
    return res
