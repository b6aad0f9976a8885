"""Router near-tie accounting for HF models: forward hooks on every top-k router record, per token, the smallest
margin between the k-th and (k+1)-th routing score over all MoE layers. Where that margin is below rounding, two
correct implementations may route the token to different experts, and the verdict must say so instead of
letting the position pass or fail silently (docs/models.md, "Random init is a trap")."""
from __future__ import annotations

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


class RouterMarginRecorder:
    def __init__(self, model: torch.nn.Module):
        self._handles = [m.register_forward_hook(self._hook) for m in model.modules() if is_router(m)]
        self._current: torch.Tensor | None = None
        self._active = False

    @property
    def num_routers(self) -> int:
        return len(self._handles)

    def _hook(self, module, args, output):
        if not self._active:
            return
        logits = output[0] if isinstance(output, tuple) else output
        margin = topk_margin(choice_scores(module, logits.reshape(-1, logits.shape[-1])), int(module.top_k))
        self._current = margin if self._current is None else torch.minimum(self._current, margin)

    def start(self) -> None:
        self._current, self._active = None, True

    def stop(self, batch: int, seq: int) -> np.ndarray | None:
        """-> (batch, seq) smallest margin per token, or None for a model without routers."""
        self._active = False
        if self._current is None:
            return None
        return self._current.reshape(batch, seq).float().cpu().numpy()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
