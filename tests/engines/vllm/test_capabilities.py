"""engines/vllm/capabilities.py: the object the registry serves for "vllm", and the facts the harness reads from
it (Qwen3.5's adapter names under the multimodal decoder root, Nemotron-H's smaller prefill step, the prefill step
from llm_kwargs, any LoRA target name)."""

from lpdiff.engines import capabilities
from lpdiff.engines.vllm.capabilities import CAPABILITIES


def test_the_registry_serves_this_modules_facts():
    assert capabilities("vllm") is CAPABILITIES and CAPABILITIES.engine == "vllm"
    assert CAPABILITIES.lora_targets_for("qwen3_moe") is None  # vLLM takes any module name


def test_decoder_root_and_prefill_steps_per_arch():
    assert CAPABILITIES.adapter_root("qwen3_5_moe") == "model.language_model"
    assert CAPABILITIES.adapter_root("qwen3_moe") is None
    assert CAPABILITIES.prefill_step_for("qwen3_moe") == 16384
    assert CAPABILITIES.prefill_step_for("nemotron_h") < 16384
    assert CAPABILITIES.prefill_step_for("qwen3_moe", {"llm_kwargs": {"max_num_batched_tokens": 512}}) == 512
