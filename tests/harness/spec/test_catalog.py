"""The catalog: full-size configs carry docs/models.md's shapes (read from the config objects; nothing full-size is
instantiated), moe_fields reads every architecture's spelling, and load_hf_model honours num_layers and seed."""

from __future__ import annotations

import pytest
import torch

from lpdiff.harness.spec.catalog import (
    INIT_RECIPE,
    ZOO,
    describe,
    get_model,
    hf_config,
    known_models,
    load_hf_model,
    moe_fields,
)
from lpdiff.harness.types import ModelSpec
from tests.helpers.configs import narrow_full_config

# docs/models.md's model table: hidden, layers, experts, top-k, expert width, shared width, heads, kv heads, head_dim,
# vocab.
DESIGN_SHAPES = {
    "qwen3-30b-a3b": (2048, 48, 128, 8, 768, 0, 32, 4, 128, 151936),
    "gpt-oss-20b": (2880, 24, 32, 4, 2880, 0, 64, 8, 64, 201088),
    "qwen3.5-35b-a3b": (2048, 40, 256, 8, 512, 512, 16, 2, 256, 248320),
    "nemotron-3-nano-30b-a3b": (2688, 52, 128, 6, 1856, 3712, 32, 2, 128, 131072),
    "nemotron-3-super-120b-a12b": (4096, 88, 512, 22, 2688, 5376, 32, 2, 128, 131072),
}


@pytest.mark.parametrize("name", list(DESIGN_SHAPES))
def test_full_size_shapes(name):
    cfg = hf_config(get_model(name))
    m = moe_fields(cfg)
    got = (
        m.hidden,
        m.num_layers,
        m.num_experts,
        m.top_k,
        m.expert_width,
        m.shared_width,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
    )
    assert got == DESIGN_SHAPES[name]


def test_full_size_quirks():
    q3 = hf_config(get_model("qwen3-30b-a3b"))
    assert "num_local_experts" in q3.to_dict() and "num_experts" not in q3.to_dict()  # saved under the other name
    assert q3.norm_topk_prob is True

    oss = hf_config(get_model("gpt-oss-20b"))
    assert oss.layer_types[:2] == ["sliding_attention", "full_attention"] and oss.sliding_window == 128
    assert oss.rope_parameters["rope_type"] == "yarn" and oss.rope_parameters["factor"] == 32.0
    assert oss.rope_parameters["rope_theta"] == 150000.0 and oss.attention_bias
    m = moe_fields(oss)
    assert m.gate_up_interleaved and m.experts_transposed and m.expert_bias and m.router_bias
    assert (m.activation, m.swiglu_alpha, m.swiglu_limit) == ("swiglu_oai", 1.702, 7.0)

    q35 = hf_config(get_model("qwen3.5-35b-a3b"))
    assert q35.layer_types.count("linear_attention") == 30 and q35.layer_types[3] == "full_attention"
    assert (q35.linear_num_key_heads, q35.linear_num_value_heads, q35.linear_key_head_dim) == (16, 32, 128)
    assert q35.rope_parameters["partial_rotary_factor"] == 0.25 and q35.rope_parameters["rope_theta"] == 1e7
    assert moe_fields(q35).shared_gate

    nem = hf_config(get_model("nemotron-3-nano-30b-a3b"))
    assert nem.hybrid_override_pattern == "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    assert "hybrid_override_pattern" not in nem.to_dict()  # accepted on load, saved as layers_block_type
    m = moe_fields(nem)
    assert (m.activation, m.gated, m.router, m.routed_scaling_factor) == ("relu2", False, "sigmoid", 2.5)
    assert len(m.moe_layers) == 23


def test_unknown_model_lists_known_names():
    with pytest.raises(KeyError) as e:
        get_model("qwen9-moe")
    for name in known_models():
        assert name in str(e.value)


def test_zoo_specs_are_paths():
    for name, arch in ZOO.items():
        spec = get_model(name)
        assert spec.path and spec.config is None and spec.arch == arch
    spec = get_model("qwen3-30b-a3b", num_layers=2)
    assert spec.init_recipe == INIT_RECIPE and spec.num_layers == 2


@pytest.mark.parametrize("name,n", [("qwen3.5-35b-a3b", 5), ("gpt-oss-20b", 3), ("nemotron-3-nano-30b-a3b", 7)])
def test_num_layers_truncates_per_layer_lists(name, n):
    full = hf_config(get_model(name))
    cfg = hf_config(get_model(name, num_layers=n))
    assert cfg.num_hidden_layers == n
    key = "layers_block_type" if name.startswith("nemotron") else "layer_types"
    assert getattr(cfg, key) == getattr(full, key)[:n]
    assert all(i < n for i in moe_fields(cfg).moe_layers)
    with pytest.raises(ValueError, match="num_layers"):
        hf_config(get_model(name, num_layers=full.num_hidden_layers + 1))


def _spec(name: str, seed: int, num_layers: int) -> ModelSpec:
    cfg = narrow_full_config(name)
    return ModelSpec(
        name="t", arch=cfg["model_type"], config=cfg, init_seed=seed, init_recipe=INIT_RECIPE, num_layers=num_layers
    )


# qwen3_moe: the plain case; nemotron_h: depth comes from layers_block_type and the prefix has no attention layer
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "nemotron-3-nano-30b-a3b"])
def test_load_hf_model_seed_and_depth(name):
    a = load_hf_model(_spec(name, 1, 4), torch.float32, "cpu")
    b = load_hf_model(_spec(name, 1, 4), torch.float32, "cpu")
    c = load_hf_model(_spec(name, 2, 4), torch.float32, "cpu")
    h = load_hf_model(_spec(name, 1, 4), torch.bfloat16, "cpu")
    assert not a.training and a.config.num_hidden_layers == 4 and len(a.model.layers) == 4
    sa, sb, sc, sh = (m.state_dict() for m in (a, b, c, h))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # same seed, same weights
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)  # another seed, other weights
    # init happens in bf16, so an fp32 run and a bf16 run hold the same weights
    assert all(torch.equal(sa[k].to(torch.bfloat16), sh[k]) for k in sa)
    assert next(h.parameters()).dtype == torch.bfloat16
    ids = torch.arange(12)[None]
    assert torch.isfinite(a(input_ids=ids).logits).all()
    two = load_hf_model(_spec(name, 1, 2), torch.float32, "cpu")
    assert len(two.model.layers) == 2


def test_load_hf_model_zoo_num_layers():
    m = load_hf_model(get_model("tiny-qwen3-moe", num_layers=2), torch.float32, "cpu")
    full = load_hf_model(get_model("tiny-qwen3-moe"), torch.float32, "cpu")
    assert len(m.model.layers) == 2
    assert torch.equal(m.model.layers[1].self_attn.q_proj.weight, full.model.layers[1].self_attn.q_proj.weight)


def test_moe_fields_zoo():
    got = {n: moe_fields(hf_config(get_model(n))) for n in ZOO}
    assert not got["tiny-qwen3-dense"].is_moe
    assert got["tiny-qwen3-moe"].norm_topk_prob and got["tiny-qwen3-moe"].router == "softmax"
    assert got["tiny-nemotron-h"].moe_layers == (1, 4) and got["tiny-nemotron-h"].shared_width > 0
    for n, m in got.items():
        if m.is_moe:
            assert m.num_experts >= 8 and m.top_k >= 2 and m.hidden <= 256 and m.num_layers <= 6, n


def test_describe_counts_params():
    d = describe(get_model("tiny-gpt-oss"))
    real = sum(p.numel() for p in load_hf_model(get_model("tiny-gpt-oss"), torch.float32, "cpu").parameters())
    assert d["params"] == real and d["experts"] == 8 and d["vocab"] == 1024
    assert describe(get_model("qwen3-30b-a3b"))["params"] > 30e9  # counted on the meta device, not allocated
