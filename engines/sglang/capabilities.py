"""SGLang's facts for the harness (doctor, check, the GPU suites): archs, layouts, targets, modes and the known
defects with the SGLang version they were read in or measured on. Importing this imports no SGLang."""

from __future__ import annotations

from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode

_V = "SGLang 0.5.15"  # file:line below are in python/sglang/srt/ of this version
_FIX_QV = "add q_proj and v_proj to the adapter (zero lora_B keeps its math)"
# the LoRA target names every SGLang model takes (utils/common.py:3985 SUPPORTED_LORA_TARGET_MODULES)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_VOCAB = ("embed_tokens", "lm_head")

CAPABILITIES = Capabilities(
    engine="sglang",
    label="SGLang",
    versions=_V,
    archs=("qwen3_moe", "gpt_oss", "qwen3_5_moe", "nemotron_h", "qwen3"),
    layouts=("peft3d", "per_expert"),
    arch_layouts=(("nemotron_h", ("peft3d", "per_expert_gate")),),
    dtypes=("bfloat16", "float16"),
    lora_fp32=False,  # no fp32 path (rmsnorm)
    max_rank=None,
    max_moe_rank=None,
    tp=(1, 2, 4, 8),
    router_lora="refused",
    adapter_doctor=True,
    install="pip install sglang==0.5.15",
    module="sglang",
    offline_python=True,
    max_lora_rank_option=True,
    # any other name has no get_hidden_dim entry (lora/utils.py:224) and the engine fails to start
    lora_targets=frozenset({*_ATTENTION, *_MLP, *_VOCAB}),
    # the hybrids' own LoRA modules, as adapter leaf names: Qwen3.5 supported_lora_modules (models/qwen3_5.py:1116)
    # with get_hidden_dim entries (:1126-1173; q_proj carries the output gate, :1130); HF's GDN names in_proj_qkv,
    # in_proj_z, in_proj_b, in_proj_a keep their names (lora/utils.py:274-278) and have none. Nemotron-H:
    # models/nemotron_h.py:861-871 and get_hidden_dim :965-1048 (gate_proj/x_proj: lora/lora.py:286)
    arch_lora_targets=(
        ("qwen3_5_moe", frozenset({*_ATTENTION, "out_proj", "in_proj_qkvz", *_MLP, *_VOCAB})),
        (
            "nemotron_h",
            frozenset(
                {*_ATTENTION, "out_proj", "in_proj", "x_proj", *_MLP, "fc1_latent_proj", "fc2_latent_proj", *_VOCAB}
            ),
        ),
    ),
    # lora/lora_config.py:42-45 reads r, lora_alpha, target_modules and use_dora only; lora/lora.py:71 scales alpha/r
    ignored_features=("rank_pattern", "alpha_pattern", "use_rslora"),
    # chunked_prefill_size: SGLang's own default on GPUs of 35-160 GB (H100, H200; 16384 from 160 GB, server_args
    # _handle_gpu_memory_settings), which lpdiff's engine keeps
    prefill_step=8192,
    prefill_step_option=("server_args", "chunked_prefill_size"),
    modes=(
        Mode("cuda_graphs_on", {"server_args": {"disable_cuda_graph": False}}, ("cuda",)),
        Mode("chunked_prefill_64", {"server_args": {"chunked_prefill_size": 64}}, ("cuda",)),
        Mode("lora_backend_csgmv", {"server_args": {"lora_backend": "csgmv"}}, ("cuda",)),
    ),
    known_defects=(
        KnownDefect(
            "peft3d-kills-sglang",
            "PEFT 3D expert adapter: SGLang 0.5.15 ignores target_parameters, 'skips' "
            "the expert tensors and its scheduler dies at the first LoRA request (lora/mem_pool.py:807, :848)",
            "convert it to the per-expert layout: {to_per_expert}",
            _V,
            layouts=("peft3d",),
        ),
        KnownDefect(
            "router-target",
            "LoRA on the MoE router ({where}) is not supported by SGLang 0.5.15: it wraps "
            "the router but has no LoRA shape for it, so the engine fails to start (lora/utils.py:224 "
            "get_hidden_dim NotImplementedError)",
            "{router_fix}",
            _V,
            when="LoRA on the MoE router",
        ),
        # q/k/v LoRA is fused into qkv_proj, which needs q_proj and v_proj (a missing k_proj gets zeros)
        KnownDefect(
            "q-without-v",
            "the adapter targets q_proj but not v_proj: SGLang fails to load it (KeyError on "
            "v_proj while fusing q/k/v)",
            "add v_proj to the adapter (a zero lora_B for v_proj keeps its math)",
            _V,
            when="q_proj without v_proj (lora/lora.py:245)",
        ),
        KnownDefect(
            "kv-without-q",
            "the adapter targets {qkv} without q_proj: SGLang loads it, then its scheduler "
            "dies at the first LoRA request (the k/v tensors match no fused qkv target)",
            _FIX_QV,
            _V,
            when="k_proj or v_proj without q_proj (lora/mem_pool.py:848)",
        ),
        KnownDefect(
            "sglang-experts-half-targeted",
            "the adapter's expert LoRA covers {parts} but not {missing}: "
            "SGLang puts LoRA on the experts only when gate/up and down are both targeted, so its expert part "
            "is silently dropped (unless an adapter loaded beside it targets both)",
            "add {missing} to the adapter's experts (zero lora_B keeps its math)",
            _V,
            layouts=("per_expert",),
            when="gated experts, not both gate/up and down (lora_manager.py:845)",
        ),
        # lora/layers.py:1176 interleaves gate/up's B; lora_moe_runners.py:342-345 and
        # triton_ops/fused_moe_lora_kernel.py:407 still apply gate's A to the first half of the rows, up's A to the
        # second: right only when they share one A (as PEFT's fused gate_up_proj LoRA does)
        KnownDefect(
            "sglang-gpt-oss-gate-up-a",
            "{differ} gpt-oss expert(s) have different lora_A for gate_proj and "
            "up_proj: SGLang 0.5.15 pairs them with the wrong half of gpt-oss's interleaved gate/up rows and "
            "computes a different delta (silently)",
            "give gate_proj and up_proj one shared lora_A per expert (PEFT's fused layout)",
            _V,
            archs=("gpt_oss",),
            layouts=("per_expert",),
            when="gate_proj and up_proj lora_A differ",
        ),
        KnownDefect(
            "sglang-target-modules-string",
            "target_modules is the pattern {pattern}: SGLang 0.5.15 accepts "
            "only a list of module names (or 'all-linear') and refuses to start",
            "save target_modules as a list of module names",
            _V,
            when="target_modules is a regex string (lora/lora_manager.py:576)",
        ),
        KnownDefect(
            "sglang-unsupported-target",
            "SGLang has no LoRA support for {bad} (0.5.x supports {supported}): the adapter fails to load",
            "drop {bad} from the adapter to run it on SGLang",
            _V,
            when="a target outside lora_targets",
        ),
        KnownDefect(
            "sglang-unsupported-target",
            "SGLang 0.5.15 has no LoRA for {bad} on {arch} (its LoRA modules "
            "there: {supported}); HF's GDN names keep their names and have no get_hidden_dim entry, so the "
            "engine fails to start (models/qwen3_5.py:1171, sglang#30168)",
            "drop {bad}: SGLang reads the GDN input projection only as the fused in_proj_qkvz "
            "(lora/lora.py:309) and has no LoRA for in_proj_b / in_proj_a at all",
            _V,
            archs=("qwen3_5_moe",),
            when="a target outside the arch's LoRA modules",
        ),
        KnownDefect(
            "sglang-unsupported-target",
            "SGLang 0.5.15 has no LoRA for {bad} on {arch} (its LoRA modules "
            "there: {supported}): the engine fails to start (models/nemotron_h.py:1046 get_hidden_dim)",
            "drop {bad} from the adapter to run it on SGLang",
            _V,
            archs=("nemotron_h",),
            when="a target outside the arch's LoRA modules",
        ),
        # target up_proj -> gate_up_proj (lora/utils.py:255), up_proj tensors keep their name (lora/lora.py:396):
        # no target at lora/mem_pool.py:848 (lora/utils.py:319). Non-gated experts read experts.{e}.gate_proj as the
        # unstacked gate_up_proj (lora/lora.py:370-377, models/nemotron_h.py:956); lora_target_modules=["all"] keeps
        # the model's up_proj (lora/utils.py:407) for shared expert / MLP, not for experts (no up_proj_moe buffer)
        KnownDefect(
            "sglang-nemotron-up-proj",
            "LoRA on the routed experts' up_proj ({where}): SGLang 0.5.15 "
            "renames the target to gate_up_proj but not the tensors, and its scheduler dies at the first "
            "LoRA batch ('Cannot find target module name for ...up_proj.lora_A.weight', lora/mem_pool.py:848;"
            " measured on Nemotron-Nano)",
            "rename each experts.N.up_proj to experts.N.gate_proj, which "
            "SGLang reads as the non-gated expert input (lora/lora.py:370): {to_per_expert_gate}",
            _V,
            archs=("nemotron_h",),
            when="per-expert tensors for experts.N.up_proj",
        ),
        KnownDefect(
            "sglang-nemotron-shared-up-proj",
            "LoRA on up_proj outside the routed experts ({where}): SGLang "
            "0.5.15 started without lora_target_modules=['all'] renames the target to gate_up_proj and its "
            "scheduler dies at the first LoRA batch (lora/utils.py:255)",
            "lpdiff's sglang engine starts it "
            "with lora_target_modules=['all'] (lora/utils.py:407); do the same when serving it",
            _V,
            archs=("nemotron_h",),
            severity="info",
            when="tensors for a shared-expert or MLP up_proj",
        ),
        # in_proj's LoRA buffers hold z and x only: A 2r rows (stacked_multiply 2, lora/utils.py:296), B
        # 2 * mamba intermediate rows (models/nemotron_h.py:1019-1022); a PEFT in_proj A (r rows) or B (z, x, B, C,
        # dt rows) fails load_lora_weight_tensor's shape assert (lora/mem_pool.py:772) at the first LoRA batch;
        # the form it reads is a gate_proj (z) + x_proj (x) pair stacked into in_proj (lora/lora.py:286-307)
        KnownDefect(
            "sglang-mamba-in-proj",
            "mamba in_proj LoRA ({where}): SGLang 0.5.15 holds LoRA for in_proj's z "
            "and x slices only (A of 2r rows, B of 2 x mamba intermediate rows); a PEFT in_proj LoRA does not "
            "fit that buffer and the first LoRA batch fails a shape assert (lora/mem_pool.py:772; measured "
            "on Nemotron-Nano: 'LoRA buffer shape [32, 2688] does not match weight shape [16, 2688]')",
            "for SGLang save it as mixer.gate_proj (z rows of B) + mixer.x_proj (x rows) with "
            "target_modules ['in_proj'] (lora/lora.py:286), possible only where B's B/C/dt rows are zero; "
            "else judge the mamba group on vLLM or HF+PEFT",
            _V,
            archs=("nemotron_h",),
            when="tensors for the mamba mixer's in_proj",
        ),
        # an error, not a warning: alpha/r in place of PEFT's scaling is a silently wrong delta whenever r != 1 or a
        # pattern changes a module's rank or alpha (lpdiff's GPU grid serves no lane doctor calls an error)
        KnownDefect(
            "sglang-ignores-scaling",
            "SGLang (0.5.15 source) ignores {features}: those modules get alpha/r "
            "scaling instead of PEFT's (silently wrong deltas)",
            "re-save the adapter with one rank and alpha and no rsLoRA (the scaling folded into B)",
            _V,
            when="an ignored_features entry is set",
        ),
        # SGLang picks "triton_kernel" for bf16 gpt-oss (arg_groups/overrides.py:566); MoE LoRA refuses it
        # (lora/layers.py:954)
        KnownDefect(
            "sglang-gpt-oss-runner",
            "gpt-oss LoRA on SGLang needs moe_runner_backend='triton': SGLang picks "
            "'triton_kernel' for bf16 gpt-oss by default (arg_groups/overrides.py:566) and its MoE LoRA "
            "refuses that runner (lora/layers.py:954)",
            "lpdiff's sglang engine sets it",
            _V,
            archs=("gpt_oss",),
            severity="info",
        ),
    ),
)
