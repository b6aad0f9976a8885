"""``sglang``: prompt logprobs from SGLang, through its offline ``sgl.Engine`` (always inside a subprocess lane) or
its HTTP ``/generate`` API (a server lpdiff launches, or one already running).

Written for SGLang 0.5.15 and checked line by line against its source (file:line below are in python/sglang/srt/ of
0.5.15); run on H100 / H200 in its offline mode by the GPU grid (benchmarks/results/engines_gpu.md: Qwen3-MoE,
gpt-oss, Qwen3.5, Nemotron-H). One concept per file: ``capabilities`` (the facts, read without SGLang),
``requests`` (ServerArgs, flags, request, response parsing), ``engine``. Tested without SGLang
(tests/engines/sglang/test_engine.py): the launch
settings, the request, the response parsing, the HTTP client against a local stand-in server, and that a dying
engine or server becomes an error carrying its log tail.

Requests: ``input_ids`` (token-id prompts; ``skip_tokenizer_init=True``), ``sampling_params={"max_new_tokens": 0}``
(0 is allowed, sampling/sampling_params.py:209, and makes the request prefill-only), ``return_logprob=True``,
``logprob_start_len=0``, ``top_logprobs_num=k``, ``lora_path=[name or None per prompt]`` (adapters registered at
start as ``lora_paths={name: path}``, server_args.py:6816; requests pick them by name). Responses:
``meta_info["input_token_logprobs"]`` = [(logprob, token_id, None)] per prompt token (text is None without
return_text_in_logprobs, managers/tokenizer_manager.py:2302), the first logprob None ([None] + logprobs[:-1],
managers/scheduler_components/logprob_result_processor.py:37); token ids >= vocab_size - 1 come back as 0
(logprob_result_processor.py:53, meant for image-token hashes). ``meta_info["input_top_logprobs"]``: None at
position 0, then a list of (logprob, token_id, None) per position.

Why a lane: a PEFT 3D expert adapter kills SGLang 0.5.15's engine at the first LoRA request: its LoRAConfig reads
target_modules only (lora/lora_config.py:42), the 3D expert tensors match no LoRA target, are "skipped"
(lora/mem_pool.py:807) and then raise ValueError in the scheduler (lora/mem_pool.py:848). In the lane that becomes a
LaneDied error with the engine's last log lines (convert the adapter: ``lpdiff adapters convert --to per_expert``).
``Engine.shutdown()`` kills SGLang's scheduler/detokenizer processes and waits for them (entrypoints/engine.py:925);
the lane then ends its whole process group (SGLang starts no process in a session of its own), so the GPU is free
for the next lane (e.g. TP 2 after TP 1).

Settings (MOE_LORA_SETTINGS) are the ones that ran MoE-LoRA on 0.5.15: triton attention, LoRA and MoE runner,
pytorch sampling, no grammar backend, no CUDA graph, no radix cache (every prompt computed in full), no server
warmup. moe_runner_backend must be "triton": MoE LoRA refuses other runners (lora/layers.py:954), and for bf16
gpt-oss SGLang would otherwise pick "triton_kernel" (arg_groups/overrides.py:566). LoRA target modules are inferred
from the adapters' target_modules lists (lora/lora_manager.py:582); the experts get LoRA only when the union names
gate/up_proj and down_proj (lora/lora_manager.py:845). max_loras_per_batch counts the base model as one adapter
(lora/lora_manager.py:277), so it is sized for every adapter plus base in one batch. SGLang has no fp32 path
(sgl_kernel rmsnorm): bf16/fp16 only. mem_fraction_static 0.5: prompt logprobs need the whole batch's
full-vocabulary logits at once (layers/logits_processor.py), which SGLang's default static fraction leaves no room
for: gpt-oss-20b (vocab 201088), 4 layers, 48 prompts x ~150 tokens went out of memory asking 5.5 GiB beside a
120 GB KV cache on an H200 (docs/engines.md, SGLang).

The model checkpoint (config-built or layer-cut models) is written by the caller's process, with the caller's
transformers, so that SGLang loads exactly the weights the HF reference builds (the SGLang bundle pins its own
transformers, whose initialisation may differ); the lane gets the finished ServerArgs.

Options (``EngineConfig.options``):
  mode               "offline" (default) | "http"
  url                http mode: a running server (its adapters must be loaded under the names used here);
                     without it lpdiff launches ``python -m sglang.launch_server`` with the same settings
  server_args        dict of ServerArgs fields merged over lpdiff's settings (e.g. {"mem_fraction_static": 0.5})
  python             the interpreter that has SGLang (offline lane and launched server); lane_env,
                     lane_start_timeout_s, lane_call_timeout_s, lane_log as in engines.subprocess_lane
  port               launched server's port (default: a free one); request_timeout_s (default: scaled from the
                     request's tokens like a lane call, see LaneConfig.call_timeout)
  checkpoint_dir     where a config-built or layer-cut model is written for SGLang to load
"""

from lpdiff.engines.sglang.capabilities import CAPABILITIES
from lpdiff.engines.sglang.engine import SGLangEngine, SGLangHTTP, SGLangOffline, resolve
from lpdiff.engines.sglang.requests import (
    ARCH_SETTINGS,
    MOE_LORA_SETTINGS,
    generate_request,
    parse_batch,
    parse_response,
    server_args,
    server_cli,
    sglang_top_k,
)

__all__ = [
    "ARCH_SETTINGS",
    "CAPABILITIES",
    "MOE_LORA_SETTINGS",
    "SGLangEngine",
    "SGLangHTTP",
    "SGLangOffline",
    "generate_request",
    "parse_batch",
    "parse_response",
    "resolve",
    "server_args",
    "server_cli",
    "sglang_top_k",
]
