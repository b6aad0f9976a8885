"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k RMSNorm per head, softmax router over all experts with
optional top-k renormalisation, gated-SiLU experts without biases, fused gate_up already gate-then-up."""

from __future__ import annotations

import torch

from lpdiff.engines.triton.config import ModelConfig, hf_common

ROUTER = "mlp.gate"


def config_from_hf(hf) -> ModelConfig:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            "this Qwen3-MoE config has dense MLP layers (mlp_only_layers / decoder_sparse_step); "
            "the triton engine runs all-MoE models only — use engine 'hf'"
        )
    if hf.hidden_act != "silu":
        raise ValueError(f"Qwen3-MoE with hidden_act={hf.hidden_act!r} is not supported (expected 'silu')")
    window = getattr(hf, "sliding_window", None)  # transformers already sets None unless use_sliding_window
    return ModelConfig(
        **hf_common(hf, "qwen3_moe", Qwen3MoeRotaryEmbedding),
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_width=hf.moe_intermediate_size,
        activation="silu",
        router="softmax_topk",
        norm_topk_prob=bool(hf.norm_topk_prob),
        router_bias=False,
        expert_bias=False,
        attention_bias=bool(hf.attention_bias),
        qk_norm=True,
        attention_sinks=False,
        sliding_windows=(window,) * hf.num_hidden_layers,
        norm_weight_fp32=False,
    )


def expert_weights(take, prefix: str):
    """-> (w_gate_up (E, 2I, H), w_down (E, H, I), b_gate_up, b_down) in the kernels' layout: HF's own."""
    return take(prefix + "gate_up_proj"), take(prefix + "down_proj"), None, None


def gate_up_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """HF gate_up row order -> kernel order (gate rows then up rows): already the same."""
    return t
