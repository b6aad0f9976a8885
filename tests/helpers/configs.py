"""Full-size catalog configs shrunk for a CPU: the same architecture, names and nesting, CPU-sized widths."""

from __future__ import annotations

import json

from lpdiff.harness.spec.catalog import FULL_CONFIGS


def narrow_full_config(name: str) -> dict:
    """The Hub config shrunk in width only (same architecture, names, nesting), CPU-sized."""
    cfg = json.loads(json.dumps(FULL_CONFIGS[name]))
    t = cfg.get("text_config", cfg)
    t.update(
        hidden_size=64,
        vocab_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts_per_tok=2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    for k in (
        "moe_intermediate_size",
        "intermediate_size",
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
    ):
        if k in t:
            t[k] = 24
    for k in ("num_local_experts", "num_experts", "n_routed_experts"):
        if k in t:
            t[k] = 8
    if "moe_latent_size" in t:
        t["moe_latent_size"] = 16
    if "linear_num_key_heads" in t:
        t.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    if "mamba_num_heads" in t:
        t.update(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2)
    if "vision_config" in cfg:
        cfg["vision_config"].update(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
    return cfg
