"""Chunked log-softmax over the vocabulary: the logprob of each actual next token plus an optional top-k,
without ever holding the batch's full fp32 logits (32k tokens x 150k vocab would be 20 GB)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def chunked_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    targets: torch.Tensor,
    top_k: int = 0,
    chunk: int = 1024,
    lm_bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    fused: bool = False,
    logits_fn: Callable[[int, int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """hidden (N, H) final-normed states, lm_head (V, H), targets (N,) -> logprobs (N,) fp32,
    topk ids (N, k) int64 and logprobs (N, k) fp32 when top_k > 0.

    Logits are formed in the model's dtype (as the engines under test do) and upcast to fp32 for the softmax.
    ``fused``: without top-k, the fp32 softmax runs in one pass over the model-dtype logits
    (kernels/logprob.py; on CUDA tensors, the torch reference elsewhere). The triton runtime uses it; the HF
    reference keeps the plain torch path.

    ``logits_fn(s, e)``: the logits of rows s:e in the model's dtype, in place of ``hidden[s:e] @ lm_head.T`` (+ bias):
    an lm_head with LoRA (PEFT's module itself, or the triton runtime's per-row adapter slots) inside the chunks.
    """
    assert hidden.ndim == 2 and lm_head.ndim == 2 and hidden.shape[1] == lm_head.shape[1]
    assert targets.shape == (hidden.shape[0],)
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    tk_ids = torch.empty(n, top_k, dtype=torch.int64, device=hidden.device) if top_k else None
    tk_lp = torch.empty(n, top_k, dtype=torch.float32, device=hidden.device) if top_k else None
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        if logits_fn is not None:
            logits = logits_fn(s, e)
        else:
            logits = hidden[s:e] @ lm_head.T  # (c, V) in model dtype
            if lm_bias is not None:
                logits = logits + lm_bias
        if fused and not top_k:
            from lpdiff.kernels.logprob import target_logprobs

            lp[s:e] = target_logprobs(logits, targets[s:e], logit_scale)
            continue
        logits = logits.float()
        if logit_scale != 1.0:
            logits = logits * logit_scale
        logz = torch.logsumexp(logits, dim=-1, keepdim=True)
        lp[s:e] = (logits.gather(1, targets[s:e, None]) - logz)[:, 0]
        if tk_ids is not None and tk_lp is not None:  # top_k > 0
            vals, ids = logits.topk(top_k, dim=-1)
            tk_ids[s:e], tk_lp[s:e] = ids, vals - logz
    return lp, tk_ids, tk_lp
