"""What the vllm engine asks vLLM for: its own options, their defaults, and the feature detection that tells vLLM
versions apart (engine arguments this vLLM lacks are not passed, and a needed one is an error that names the fix;
``LoRARequest`` / ``SamplingParams`` fields are read off the struct), never version strings."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

from lpdiff.harness.spec.errors import InputError

# vLLM's allowed max_lora_rank values (0.25-0.32); read from vLLM itself when it says.
FALLBACK_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
OWN_OPTIONS = (
    "max_lora_rank",
    "max_loras",
    "max_num_seqs",
    "max_model_len",
    "max_logprobs",
    "mixed_moe_lora_format",
    "gpu_memory_utilization",
    "attention_backend",
    "seed",
    "enable_prefix_caching",
    "allow_fp32_lora",
    "checkpoint_dir",
    "enforce_eager",
    "close_timeout_s",
    "llm_kwargs",
    "env",
    "capture_routing",
)
GPU_MEMORY_UTILIZATION = 0.6
# tokens per step for Nemotron-H MoE-LoRA (vllm-nemotron-step-fault in engines/vllm/capabilities.py has the
# measurements). Nano's engine died wherever tokens per step x TP reached 8192 (8192 at TP 1, 4096 at TP 2, 2048 at
# TP 4; Super at TP 4 too) and ran wherever it stayed at 4096 or below (4096 and 2048 at TP 1, 2048 and 1024 at
# TP 2, 1024 at TP 4 for Nano and Super): at most 2048 per step, and 4096 / TP above TP 2
NEMOTRON_LORA_STEP_TOKENS = 2048
NEMOTRON_LORA_STEP_X_TP = 4096


# tokens per step for MoE-LoRA while vLLM returns routed experts (capture_routing; issue 43). Measured on an H200,
# vLLM 0.25.1, Qwen3-30B-A3B x4 bf16, 5 per-expert adapters + base rows, 48 sequences of 33-256 tokens (7302 tokens, one
# step): with enable_return_routed_experts at vLLM's own 16384-token step the engine died with an illegal memory access
# on its second call of that same batch (1 of 1 engines; the first call had returned); without it vLLM served such
# batches at 16384 (benchmarks/results/detection.csv: Qwen3-30B-A3B x4, 3 reruns on an H200, 20 on an H100) and the
# grid's at 4096 (suites/test_engines_gpu.py GRID_MAX_STEP) all day. The capturer's own GPU writes cannot leave
# their buffers (routed_experts_capturer.py: slice copies that torch shape-checks on the host, into buffers of
# max_num_batched_tokens x layers x top_k), so the fault is read as this vLLM's MoE-LoRA illegal-access family, which
# larger steps expose (vllm-nemotron-step-fault): lpdiff runs capture at the grid's step, where that path ran
ROUTING_CAPTURE_LORA_STEP_TOKENS = 4096


def routing_capture_step_tokens(step: int | None) -> int:
    """max_num_batched_tokens lpdiff's vllm engine asks for on MoE-LoRA with capture_routing, given the step it asks
    for otherwise (None: vLLM's default, 16384 on an H200): the smaller of that and ROUTING_CAPTURE_LORA_STEP_TOKENS."""
    return ROUTING_CAPTURE_LORA_STEP_TOKENS if step is None else min(step, ROUTING_CAPTURE_LORA_STEP_TOKENS)


def nemotron_step_tokens(tp: int) -> int:
    """max_num_batched_tokens lpdiff's vllm engine asks for on Nemotron-H MoE-LoRA at tensor parallelism ``tp``."""
    return min(NEMOTRON_LORA_STEP_TOKENS, NEMOTRON_LORA_STEP_X_TP // max(tp, 1))


def pick_max_lora_rank(ranks: Sequence[int], allowed: Sequence[int] = FALLBACK_RANKS) -> int:
    """The smallest rank vLLM accepts that holds every adapter's rank."""
    need = max(ranks, default=1)
    fits = [r for r in sorted(allowed) if r >= need]
    if not fits:
        raise InputError(
            f"adapter rank {need} exceeds vLLM's largest max_lora_rank {max(allowed)}; re-train or "
            f"truncate the adapter to rank <= {max(allowed)}"
        )
    return fits[0]


def allowed_ranks() -> tuple[int, ...]:
    try:
        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(int(r) for r in typing.get_args(MaxLoRARanks))
        return ranks or FALLBACK_RANKS
    except ImportError:
        return FALLBACK_RANKS


def default_attention_backend(dtype: str) -> str:
    """FlashAttention (what ran MoE-LoRA on 0.25.1, FA3 with gpt-oss's sinks on Hopper) takes fp16/bf16 only
    (flash_attn.py:68); Triton attention takes fp32 too and has sinks."""
    return "TRITON_ATTN" if dtype == "float32" else "FLASH_ATTN"


def struct_fields(cls) -> set[str]:
    """Field names of a vLLM msgspec struct or dataclass: how the engine tells vLLM versions apart."""
    names = getattr(cls, "__struct_fields__", None)
    return set(names) if names else {f.name for f in dataclasses.fields(cls)}
