"""Tiny qwen3_moe and gpt_oss checkpoints (random init with a wide initializer so that distributions are peaked and
an adapter moves logprobs far above the 1e-4 tolerance) with adapters in the three layouts the harness makes, and
the triton engine run on them: shared by the triton engine tests (fixture ``tiny`` in tests/engines/triton/
conftest.py)."""

from __future__ import annotations

import numpy as np
import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.harness.types import AdapterSpec, ModelSpec

TOL = 1e-4
SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    initializer_range=0.15,
    tie_word_embeddings=False,
)
ARCHS = {
    # head_dim 16: the sink logit goes through a non-power-of-two scale; 2 layers: sliding then full attention
    "gpt_oss": dict(
        SMALL,
        num_local_experts=8,
        intermediate_size=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=7.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
            "rope_theta": 150000.0,
        },
    ),
    # expert width 24: not a multiple of any block size; norm_topk_prob on
    "qwen3_moe": dict(SMALL, num_experts=8, moe_intermediate_size=24, intermediate_size=96, norm_topk_prob=True),
}
# (name, generate_adapter kwargs): every layout the harness writes, ranks that differ (slots padded to the max).
# "experts_pe" reaches the triton engine in the per_expert layout and HF+PEFT as the peft3d original (PEFT cannot
# load per-expert adapters on gpt-oss).
ADAPTERS = {
    "attn_experts": dict(groups=("attention", "experts"), rank=4, seed=1),
    "experts_pe": dict(groups=("experts",), rank=6, seed=2),
    "shared_outer": dict(groups=("attention", "experts"), rank=3, seed=3, shared_outer=True),
}
LENS = [9, 17, 4, 23, 12]  # ragged; longer than the sliding window


def build_tiny(arch: str, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.harness.spec.adapters import convert_adapter, generate_adapter

    root = tmp_path_factory.mktemp(arch)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **ARCHS[arch])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # sharded checkpoint for qwen (index.json), one file for gpt-oss: both loader paths
    model.save_pretrained(root / "model", max_shard_size="100KB" if arch == "qwen3_moe" else "1GB")
    hf = {
        name: AdapterSpec(name, str(generate_adapter(model, root / name, **kw).path)) for name, kw in ADAPTERS.items()
    }
    per_expert = convert_adapter(hf["experts_pe"].path, root / "experts_pe_per_expert", "per_expert", cfg)
    adapters = {"hf": hf, "triton": {**hf, "experts_pe": AdapterSpec("experts_pe", per_expert.path)}}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    return ModelSpec(name=f"tiny-{arch}", arch=arch, path=str(root / "model")), adapters, prompts


def run_triton(spec, adapters, prompts, choice, top_k=0, **kw):
    from lpdiff.engines.triton import TritonEngine

    with TritonEngine(
        EngineConfig(model=spec, adapters=adapters["triton"], dtype="float32", device="cpu", **kw)
    ) as eng:
        return eng.prompt_logprobs(prompts, choice, top_k=top_k)


def maxdiff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b))
