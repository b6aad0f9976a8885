"""The zoo's models: the five tiny configs, transformers' seeded init of one, and the Hub spellings its saved
config.json carries for engines with older transformers."""

from __future__ import annotations

import torch

from lpdiff.harness.build.zoo_data import VOCAB
from lpdiff.harness.spec.catalog import ZOO
from lpdiff.harness.spec.errors import UnknownName

SEED = 0

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
    initializer_range=0.02,
)

# Within the brief's limits: hidden <= 256, <= 6 layers, >= 8 experts, top-k >= 2, about 1M params (4 MB fp32).
# Most expert widths are not multiples of 32 on purpose: kernels that forget to mask partial blocks must fail here.
TINY_CONFIGS: dict[str, dict] = {
    "tiny-qwen3-moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        intermediate_size=256,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "tiny-gpt-oss": dict(
        _COMMON,
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        num_hidden_layers=4,
        num_local_experts=8,
        num_experts_per_tok=4,
        intermediate_size=40,
        attention_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=16,
        rms_norm_eps=1e-5,
        swiglu_limit=7.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 256,
            "truncate": False,
            "rope_theta": 150000.0,
        },
    ),
    "tiny-qwen3.5-moe": dict(
        _COMMON,
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "tiny-nemotron-h": dict(
        _COMMON,
        model_type="nemotron_h",
        architectures=["NemotronHForCausalLM"],
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"],
        mamba_num_heads=4,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        expand=1,
        chunk_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=96,
        intermediate_size=160,
        mlp_hidden_act="relu2",
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        layer_norm_epsilon=1e-5,
        use_mamba_kernels=False,
    ),
    "tiny-qwen3-dense": dict(
        _COMMON,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        num_hidden_layers=4,
        intermediate_size=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
assert set(TINY_CONFIGS) == set(ZOO)


def tiny_config(name: str):
    from transformers import AutoConfig

    if name not in TINY_CONFIGS:
        raise UnknownName(f"unknown zoo model {name!r}; known: {', '.join(TINY_CONFIGS)}")
    kw = dict(TINY_CONFIGS[name])
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def init_model(name: str, seed: int = SEED):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)


def hub_compat(cfg: dict) -> dict:
    """Add the spellings the Hub's real config.json files use next to transformers 5's, so that engines reading
    configs with older transformers (vLLM, SGLang bundles) see the same model; transformers 5 ignores them."""
    cfg = dict(cfg)
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg["num_local_experts"]
    if cfg["model_type"] == "nemotron_h":
        letters = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
        cfg["hybrid_override_pattern"] = "".join(letters[t] for t in cfg["layers_block_type"])
        cfg["num_hidden_layers"] = len(cfg["layers_block_type"])
    return cfg
