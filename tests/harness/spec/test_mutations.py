"""Each adapter mutation breaks exactly what it says, checked against PEFT's merge_and_unload."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

from lpdiff.harness.spec import mutations

E = 4
CONFIGS = {
    # gate/up concatenated, (E, 2I, H) experts
    "qwen3_moe": Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=2,
    ),
    # transposed (E, H, 2I) and interleaved experts: the expert axis must still be found
    "gpt_oss": GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=E,
        num_experts_per_tok=2,
    ),
}


def merged_experts(base_dir, adapter_dir):
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).merge_and_unload()
    ex = model.model.layers[0].mlp.experts
    return ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()


@pytest.fixture(scope="module", params=list(CONFIGS))
def adapter(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[request.param]).save_pretrained(d / "m")
    m = AutoModelForCausalLM.from_pretrained(d / "m")
    cfg = LoraConfig(
        r=3,
        lora_alpha=6,
        target_modules=["q_proj"],
        init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    get_peft_model(m, cfg).save_pretrained(d / "a")
    base = AutoModelForCausalLM.from_pretrained(d / "m").model.layers[0].mlp.experts
    return d, (base.gate_up_proj.detach(), base.down_proj.detach())


def test_zero_expert_drops_exactly_that_expert(adapter, tmp_path):
    d, base = adapter
    good = merged_experts(d / "m", d / "a")
    bad = merged_experts(d / "m", mutations.zero_expert(d / "a", tmp_path / "z", expert=2))
    for b, g, w in zip(bad, good, base):
        torch.testing.assert_close(b[2], w[2])  # expert 2 is back to the base weight
        torch.testing.assert_close(b[[0, 1, 3]], g[[0, 1, 3]])  # the others keep their delta
        assert (g[2] - w[2]).abs().max() > 1e-3


def test_scale_and_permute(adapter, tmp_path):
    d, base = adapter
    good = merged_experts(d / "m", d / "a")
    scaled = merged_experts(d / "m", mutations.scale_experts(d / "a", tmp_path / "s", 2.0))
    for s, g, w in zip(scaled, good, base):
        torch.testing.assert_close(s - w, 2 * (g - w), atol=1e-6, rtol=1e-5)
    perm = merged_experts(d / "m", mutations.permute_experts(d / "a", tmp_path / "p"))
    assert any((p - g).abs().max() > 1e-3 for p, g in zip(perm, good))
