"""Load a model's weights once into kernel-ready layouts, already sharded for this tensor-parallel rank:
q|k|v concatenated for one ``lora_linear`` with three slices, expert gate_up as (E, 2I, H) gate-then-up,
expert down as (E, H, I)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lpdiff.engines.triton.archs import arch_module
from lpdiff.engines.triton.config import ModelConfig
from lpdiff.engines.triton.shard import Shard

Tensor = torch.Tensor


@dataclass(slots=True)
class LayerWeights:
    input_norm: Tensor  # (H,)
    post_norm: Tensor  # (H,)
    qkv: Tensor  # (q_loc + 2 kv_loc, H)
    qkv_bias: Tensor | None
    q_norm: Tensor | None  # (head_dim,)
    k_norm: Tensor | None
    sinks: Tensor | None  # (heads_loc,)
    o: Tensor  # (H, q_loc)
    o_bias: Tensor | None  # rank 0 only: added once before the all-reduce
    router: Tensor  # (E, H), replicated
    router_bias: Tensor | None
    w_gate_up: Tensor  # (E, 2 I_loc, H)
    w_down: Tensor  # (E, H, I_loc)
    b_gate_up: Tensor | None  # (E, 2 I_loc)
    b_down: Tensor | None  # (E, H), rank 0 only


@dataclass(slots=True)
class ModelWeights:
    embed: Tensor  # (V, H)
    norm: Tensor  # (H,)
    lm_head: Tensor  # (V, H)
    layers: list[LayerWeights]

    def nbytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors += [getattr(layer, f) for f in LayerWeights.__slots__]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def load_weights(cfg: ModelConfig, source, shard: Shard, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    arch = arch_module(cfg.arch)

    def take(name: str, want_dtype: torch.dtype = dtype) -> Tensor:
        return source.take(name).to(device=device, dtype=want_dtype)

    def take_opt(name: str, present: bool, want_dtype: torch.dtype = dtype) -> Tensor | None:
        return take(name, want_dtype) if present else None

    def fin(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.contiguous()

    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    norm_dtype = torch.float32 if cfg.norm_weight_fp32 else dtype
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
        qkv_bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
        o_bias = take_opt(a + "o_proj.bias", cfg.attention_bias)
        sinks = take_opt(a + "sinks", cfg.attention_sinks)
        gu, down, b_gu, b_down = arch.expert_weights(take, p + "mlp.experts.")
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight", norm_dtype),
                post_norm=take(p + "post_attention_layernorm.weight", norm_dtype),
                qkv=shard.split_qkv(qkv, 0, *heads).contiguous(),
                qkv_bias=fin(None if qkv_bias is None else shard.split_qkv(qkv_bias, 0, *heads)),
                q_norm=take_opt(a + "q_norm.weight", cfg.qk_norm),
                k_norm=take_opt(a + "k_norm.weight", cfg.qk_norm),
                sinks=fin(None if sinks is None else shard.split_heads(sinks, 0, cfg.num_heads, cfg.num_kv_heads, 1)),
                o=shard.split_heads(take(a + "o_proj.weight"), 1, *heads).contiguous(),
                o_bias=o_bias if shard.first else None,
                router=take(p + arch.ROUTER + ".weight"),
                router_bias=take_opt(p + arch.ROUTER + ".bias", cfg.router_bias),
                w_gate_up=shard.split_gate_up(gu, 1).contiguous(),
                w_down=shard.split(down, 2).contiguous(),
                b_gate_up=fin(None if b_gu is None else shard.split_gate_up(b_gu, 1)),
                b_down=b_down if shard.first else None,
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else take("lm_head.weight")
    return ModelWeights(embed=embed, norm=take("model.norm.weight", norm_dtype), lm_head=lm_head, layers=layers)
