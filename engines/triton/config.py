"""The runtime's view of a model: one slotted config normalised from a transformers config, whatever the arch.

Each supported arch has a small file (qwen3_moe.py, gpt_oss.py; archs.py maps names to them) that fills this from the
HF config and says how its expert weights map to the kernels' layout; everything else in the runtime reads only
``ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Rope types whose inverse frequencies do not depend on the sequence length: a prefill-only runtime computes
# them once. Dynamic kinds rescale with the batch's length and would need per-batch recomputation.
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_width: int  # I: width of one expert's gate (and of its up) projection
    activation: str  # kernels' name: "silu" (gated SiLU) | "swiglu_oai" (gpt-oss clamped SwiGLU)
    # "softmax_topk": softmax over all experts then top-k (Qwen); "topk_softmax": top-k logits then softmax (gpt-oss)
    router: str
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (softmax_topk only)
    router_bias: bool
    expert_bias: bool
    attention_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    attention_sinks: bool  # one learned logit per head that joins every softmax (gpt-oss)
    sliding_windows: tuple[int | None, ...]  # per layer: window size or None (full causal)
    rms_norm_eps: float
    norm_weight_fp32: bool  # gpt-oss keeps norm weights in fp32 and multiplies before the downcast
    tie_word_embeddings: bool
    rope_inv_freq: torch.Tensor  # (head_dim // 2,) float32, from transformers' own rope init
    rope_attention_scaling: float  # YaRN's cos/sin multiplier (1.0 for plain rope)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "query heads must be a multiple of kv heads"
        assert 1 <= self.top_k <= self.num_experts
        assert self.activation in ("silu", "swiglu_oai"), self.activation
        assert self.router in ("softmax_topk", "topk_softmax"), self.router
        assert len(self.sliding_windows) == self.num_layers
        assert self.rope_inv_freq.shape == (self.head_dim // 2,)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rope_from_hf(rotary_cls: type, hf_config) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as the HF model computes them (YaRN included), on the CPU."""
    rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported by the triton engine (prefill-only, static "
            f"frequencies); supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    with torch.device("cpu"):
        rotary = rotary_cls(config=hf_config)
    return rotary.inv_freq.float().clone(), float(rotary.attention_scaling)


def hf_common(hf, arch: str, rotary_cls: type) -> dict[str, Any]:
    """The ModelConfig fields every decoder reads the same way from its HF config; the rope through the model's own
    rotary class (rope_from_hf)."""
    inv_freq, attn_scaling = rope_from_hf(rotary_cls, hf)
    return {
        "arch": arch,
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "num_layers": hf.num_hidden_layers,
        "num_heads": hf.num_attention_heads,
        "num_kv_heads": hf.num_key_value_heads,
        "rms_norm_eps": hf.rms_norm_eps,
        "tie_word_embeddings": bool(hf.tie_word_embeddings),
        "rope_inv_freq": inv_freq,
        "rope_attention_scaling": attn_scaling,
    }


SUPPORTED_ARCHS = ("qwen3_moe", "gpt_oss", "qwen3_5_moe", "nemotron_h")
