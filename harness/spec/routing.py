"""Router hooks for HF models: forward hooks on every top-k router record, per token, the smallest margin between
the k-th and (k+1)-th routing score over all MoE layers. Where that margin is below rounding, two correct
implementations may route the token to different experts, and the verdict must say so instead of letting the
position pass or fail silently (docs/models.md, "Random init is a trap").

Asked to (``capture=True``), the same hooks keep each MoE layer's chosen expert ids, its top-k margin and the
top-k weights; given forced ids (``start(forced=...)``), they replace the router's choice with them and recompute
the weights from the router's own logits with its arch's weighting (``replay_weights``): routing replay, the
reference run with an engine's expert choices, so that a comparison excludes routing flips.

transformers 5.17's routers (Qwen3MoeTopKRouter, Qwen3_5MoeTopKRouter, GptOssTopKRouter, NemotronHTopkRouter)
all return ``(router_logits, top-k weights, top-k indices)``; a hook's return value replaces that output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch


def choice_scores(module: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The scores the router ranks experts by: logits for softmax routers (a logit gap is the log of the
    probability ratio), sigmoid + correction bias for Nemotron-style routers."""
    bias = getattr(module, "e_score_correction_bias", None)
    if bias is not None:
        return logits.float().sigmoid() + bias.float()
    return logits.float()


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(N, E) scores -> (N,) gap between the k-th and (k+1)-th largest score."""
    top = scores.topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.lower().endswith("router") and hasattr(module, "top_k")


def router_kind(module: torch.nn.Module) -> str:
    """How the router turns logits into top-k weights: "sigmoid" (Nemotron-H: sigmoid scores, correction bias for
    the choice only, gathered, normalised, x routed_scaling_factor), "topk_softmax" (gpt-oss: softmax over the k
    chosen logits) or "softmax_topk" (Qwen3-MoE, Qwen3.5: softmax over all experts, gathered, renormalised when
    norm_topk_prob; Qwen3.5's router has no such flag and always renormalises)."""
    if getattr(module, "e_score_correction_bias", None) is not None:
        return "sigmoid"
    if type(module).__name__.startswith("GptOss"):
        return "topk_softmax"
    return "softmax_topk"


def replay_weights(module: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(N, E) router logits, (N, K) expert ids -> (N, K) weights as ``module``'s own forward computes them for
    those ids, in the dtype it returns them (the logits' own: fp32 for Nemotron-H, the model dtype otherwise).
    Written out per arch because transformers' routers pick and weight in one forward with no way to pass ids;
    given the ids the router chose itself, each branch reproduces its output bit for bit (same ops, same order)."""
    kind = router_kind(module)
    if kind == "softmax_topk":
        w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
        if getattr(module, "norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype)
    if kind == "topk_softmax":
        top = logits.gather(1, ids)
        return torch.softmax(top, dim=1, dtype=top.dtype)
    w = logits.sigmoid().gather(1, ids)
    if module.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    # a float attribute of Nemotron-H's router, which nn.Module's __getattr__ types as Tensor | Module
    return w * cast(float, module.routed_scaling_factor)


def forced_ids(routing: Sequence[np.ndarray], seq: int, num_layers: int, device) -> list[torch.Tensor]:
    """Per-prompt (n_i, L, K) expert ids -> per layer (len(routing) * seq, K) long rows of a right-padded batch
    of width ``seq``; rows a prompt does not fill (padding) and ids < 0 (not reported) are -1: the router keeps
    its own choice there."""
    ks = {np.asarray(r).shape[2] for r in routing if np.asarray(r).ndim == 3}
    bad = [i for i, r in enumerate(routing) if np.asarray(r).ndim != 3 or np.asarray(r).shape[1] != num_layers]
    if bad or len(ks) != 1:
        raise ValueError(
            f"routing replay needs (tokens, {num_layers} MoE layers, top_k) expert ids per prompt; "
            f"prompt {bad[0] if bad else 0} has shape {np.asarray(routing[bad[0] if bad else 0]).shape}"
        )
    k = ks.pop()
    out = np.full((len(routing), seq, num_layers, k), -1, dtype=np.int64)
    for i, r in enumerate(routing):
        out[i, : len(r)] = r
    t = torch.from_numpy(out.reshape(len(routing) * seq, num_layers, k)).to(device)
    return [t[:, layer] for layer in range(num_layers)]


class RouterMarginRecorder:
    def __init__(self, model: torch.nn.Module, capture: bool = False):
        routers = [m for m in model.modules() if is_router(m)]
        self._layer = {id(m): i for i, m in enumerate(routers)}  # MoE layer index, in decoder order
        self._handles = [m.register_forward_hook(self._hook) for m in routers]
        self.capture = capture
        self._current: torch.Tensor | None = None
        self._active = False
        self._forced: list[torch.Tensor] | None = None
        self._caught: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def num_routers(self) -> int:
        return len(self._handles)

    def _hook(self, module, args, output):
        if not self._active:
            return None
        logits = output[0] if isinstance(output, tuple) else output
        flat = logits.reshape(-1, logits.shape[-1])
        margin = topk_margin(choice_scores(module, flat), int(module.top_k))
        self._current = margin if self._current is None else torch.minimum(self._current, margin)
        if self._forced is None and not self.capture:
            return None
        _, weights, ids = output
        layer = self._layer[id(module)]
        replaced = None
        if self._forced is not None:
            forced = self._forced[layer]
            if forced.shape != ids.shape:
                raise ValueError(
                    f"routing replay: MoE layer {layer} routes {tuple(ids.shape)} (tokens, top_k), the "
                    f"forced ids are {tuple(forced.shape)}"
                )
            ids = torch.where(forced[:, :1] < 0, ids, forced)
            weights = replay_weights(module, flat, ids)
            replaced = (logits, weights, ids)
        if self.capture:
            self._caught[layer] = (ids, margin, weights.float())
        return replaced

    def start(self, forced: list[torch.Tensor] | None = None) -> None:
        """Record the next forward; ``forced`` (forced_ids' per-layer rows) replaces the routers' choices."""
        if forced is not None and len(forced) != self.num_routers:
            raise ValueError(f"routing replay got ids for {len(forced)} MoE layers; the model has {self.num_routers}")
        self._current, self._active, self._forced, self._caught = None, True, forced, {}

    def routing(self, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """After stop(): (batch, seq, L, K) int32 expert ids, (batch, seq, L) margins and (batch, seq, L, K)
        weights of the captured forward, or None (nothing captured, or a model without routers)."""
        if not self._caught:
            return None
        layers = [self._caught[i] for i in range(self.num_routers)]
        ids, margins, weights = (torch.stack([c[j] for c in layers], dim=1) for j in range(3))
        k = ids.shape[-1]
        return (
            ids.reshape(batch, seq, -1, k).to(torch.int32).cpu().numpy(),
            margins.reshape(batch, seq, -1).float().cpu().numpy(),
            weights.reshape(batch, seq, -1, k).cpu().numpy(),
        )

    def stop(self, batch: int, seq: int) -> np.ndarray | None:
        """-> (batch, seq) smallest margin per token, or None for a model without routers."""
        self._active, self._forced = False, None
        if self._current is None:
            return None
        return self._current.reshape(batch, seq).float().cpu().numpy()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
