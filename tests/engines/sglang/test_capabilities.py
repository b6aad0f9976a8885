"""engines/sglang/capabilities.py: the object the registry serves for "sglang", and the facts its comments cite
from SGLang 0.5.15 as the harness reads them (LoRA targets per arch, Nemotron-H's gate-named per-expert layout, the
prefill step and its server_args override, no fp32 path)."""

from lpdiff.engines import capabilities
from lpdiff.engines.sglang.capabilities import CAPABILITIES


def test_the_registry_serves_this_modules_facts():
    assert capabilities("sglang") is CAPABILITIES and CAPABILITIES.engine == "sglang"
    assert "float32" not in CAPABILITIES.dtypes and not CAPABILITIES.lora_fp32


def test_lora_targets_and_layouts_per_arch():
    assert "in_proj" in CAPABILITIES.lora_targets_for("nemotron_h")  # Nemotron-H's mamba in_proj has LoRA there
    assert "in_proj" not in CAPABILITIES.lora_targets_for("qwen3_moe")  # no get_hidden_dim entry elsewhere
    assert "in_proj_qkvz" in CAPABILITIES.lora_targets_for("qwen3_5_moe")
    assert "per_expert_gate" in CAPABILITIES.layouts_for("nemotron_h")
    assert "per_expert_gate" not in CAPABILITIES.layouts_for("qwen3_moe")


def test_prefill_step_default_and_from_server_args():
    assert CAPABILITIES.prefill_step_for("qwen3_moe") == 8192
    assert CAPABILITIES.prefill_step_for("qwen3_moe", {"server_args": {"chunked_prefill_size": 64}}) == 64
    assert CAPABILITIES.mode_table()["chunked_prefill_64"].options == {"server_args": {"chunked_prefill_size": 64}}
