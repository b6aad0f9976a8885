"""gpt-oss (20b, 120b): attention with bias and per-head sinks, sliding window on alternate layers, YaRN rope,
router with bias (top-k on logits, then softmax over the k), experts with biases and clamped SwiGLU whose gate and
up columns are interleaved and whose weights are stored transposed ((E, in, out))."""

from __future__ import annotations

import torch

from lpdiff.engines.triton.config import ModelConfig, hf_common

ROUTER = "mlp.router"


def config_from_hf(hf) -> ModelConfig:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    return ModelConfig(
        **hf_common(hf, "gpt_oss", GptOssRotaryEmbedding),
        head_dim=hf.head_dim,
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        expert_width=hf.intermediate_size,
        activation="swiglu_oai",
        router="topk_softmax",
        norm_topk_prob=False,
        router_bias=True,
        expert_bias=True,
        attention_bias=bool(hf.attention_bias),
        qk_norm=False,
        attention_sinks=True,
        sliding_windows=windows,
        norm_weight_fp32=True,
    )


def gate_up_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up rows (g0 u0 g1 u1 ...) -> gate rows then up rows, along ``dim``."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def expert_weights(take, prefix: str):
    """-> (w_gate_up (E, 2I, H), w_down (E, H, I), b_gate_up (E, 2I), b_down (E, H)) in the kernels' layout."""
    gu = take(prefix + "gate_up_proj")  # (E, H, 2I), interleaved columns
    down = take(prefix + "down_proj")  # (E, I, H)
    return (
        gate_up_rows(gu.transpose(1, 2), 1),
        down.transpose(1, 2).contiguous(),
        gate_up_rows(take(prefix + "gate_up_proj_bias"), 1),
        take(prefix + "down_proj_bias"),
    )
