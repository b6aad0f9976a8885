"""Sparse MoE block: router in torch (replicated on every rank), experts through the fused MoE-LoRA kernel
(experts sharded on their width under TP, partial outputs summed by the caller's all-reduce)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.triton.config import ModelConfig
from engines.triton.weights import LayerWeights
from harness.routing import topk_margin


def route(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> topk ids (T, K), topk weights (T, K) float32, routing margin (T,) float32.

    Rounding follows transformers: Qwen takes the softmax in fp32 and casts the (renormalised) top-k weights to
    the model dtype; gpt-oss takes top-k on the logits and a softmax in the model dtype. The margin is the logit gap
    between the k-th and (k+1)-th expert (the log of their probability ratio), as harness.routing defines it.
    """
    logits = F.linear(x, w.router, w.router_bias)
    if cfg.router == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = top.to(logits.dtype)
    else:
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    if cfg.top_k < cfg.num_experts:
        margin = topk_margin(logits.float(), cfg.top_k)
    else:
        margin = torch.full((x.shape[0],), float("inf"), device=x.device)
    return ids, weights.float(), margin


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
            lora, token_adapter: torch.Tensor | None, impl: str) -> torch.Tensor:
    from kernels import moe_forward

    use_lora = lora is not None and token_adapter is not None
    return moe_forward(x, ids, weights, w.w_gate_up, w.w_down, cfg.activation, b_gate_up=w.b_gate_up,
                       b_down=w.b_down, lora=lora if use_lora else None,
                       token_adapter=token_adapter if use_lora else None, impl=impl)
