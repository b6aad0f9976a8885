"""``triton``: lpdiff's own prefill-only MoE-LoRA runtime for qwen3_moe, gpt_oss, qwen3_5_moe and nemotron_h
(hybrids built whole by their own modules, archs.HYBRIDS: Qwen3.5-MoE's Gated DeltaNet / gated attention / shared-
expert MoE by engines/triton/qwen3_5.py, its conv and delta rule in torch (gdn.py) except 16-bit CUDA runs, which
take fla-core's chunked kernel when the ``fla`` extra is installed; Nemotron-H's Mamba-2 / attention / relu² MoE
hybrid by engines/triton/nemotron_h.py, its mamba conv and SSD scan as Triton kernels on the kernels path
(kernels/ssd_varlen.py; the scan optionally mamba_ssm's chunked kernels, option mamba_scan), torch ops otherwise,
kernels/ssd.py).

Loads an HF checkpoint directory (safetensors, sharded or not, per-expert or fused experts) or builds a
config-specified model with the seeded recipe on the device; stacks every configured adapter into LoRA slots so
that each prompt of a batch picks one or none; runs packed variable-length prefill (no KV cache) with LoRA on
q/k/v/o and every expert's gate_up/down through kernels/; returns float32 logprobs from a chunked log-softmax,
top-k on request, and each token's smallest router margin. Tensor parallelism 1/2/4/8: ``with`` spawns the
workers and tears them down. Without a GPU it runs on the kernels' torch references (or the Triton interpreter
under TRITON_INTERPRET=1).

Options (``EngineConfig.options``; validated once into options.TritonOptions):
  impl              "auto" | "triton" | "torch": kernels implementation (auto: Triton on CUDA, torch otherwise)
  attention         "auto" | "triton" | "flash" | "sdpa": auto is the Triton kernel (kernels/attention.py) for
                    bf16/fp16 on CUDA, except padded SDPA for plain causal prompts of one length, else SDPA
                    (engines/triton/attention.py)
  max_batch_tokens  packed tokens per forward (default 8192)
  logit_chunk       rows per log-softmax chunk (default 1024)
  timeout_s         tensor-parallel start-up and collective timeout (default 600)
  fault             None (default) or a bug-zoo fault name (kernels/faults.py; also $LPDIFF_FAULT)
  moe_backend       "triton" (default: the fused MoE-LoRA kernel) | "grouped_mm" (torch's CUTLASS grouped GEMM for
                    the expert bases + Triton LoRA passes; bf16 on sm90/sm100, else the fused kernel;
                    kernels/moe_grouped.py)
  moe_lora_shrink   the expert GEMMs' LoRA shrink: "auto" (default; = "once", kernels.fused_moe_lora.LORA_SHRINK),
                    "once" (its own launch), "fused" (in every program's K-loop) or "fused:G,D" (in the first of
                    the G (gate_up) / D (down) N tiles each program walks); numerics alike, for timing them
  moe_padding       what the expert GEMMs do with a group's padding rows: "auto" (default;
                    kernels.fused_moe_lora.auto_padding), "compute" (a real row, no mask), "zero" (loaded as zeros:
                    less energy under the GPU's power cap) or "half" ("zero", and a group's last block with at most
                    half its rows used runs as a half-height tile); numerics alike (bit-identical in bf16)
  cuda_graphs       CUDA graphs kept of whole calls (default 4; 0 = none; TP 1 on CUDA only): a batch layout (prompt
                    lengths, adapter per prompt, top-k) seen a second time is captured, and replayed from then on
                    with the new token ids (engines/triton/graphs.py); that second call costs about two forwards
                    (a warm-up and the capture)
  capture_routing   return each token's expert ids, top-k weights and margin per MoE layer (default False; the
                    calls then run without CUDA graphs; engines/triton/routing.py)
  mamba_scan        Nemotron-H's SSD scan: "auto" (default: chunked for bf16/fp16 on CUDA, else the recurrence;
                    engines/triton/mamba.py), "recurrence" (kernels/ssd_varlen.py on the kernels path, fp32 states)
                    or "chunked" (mamba_ssm's chunked Triton kernels, vendored: kernels/ssd_chunked.py; IEEE dots
                    for fp32 inputs)
"""

from lpdiff.engines.capabilities import Capabilities, Mode
from lpdiff.engines.triton.config import SUPPORTED_ARCHS

CAPABILITIES = Capabilities(
    engine="triton",
    label="lpdiff-triton",
    versions="this lpdiff",
    archs=SUPPORTED_ARCHS,
    layouts=("peft3d", "per_expert"),
    dtypes=("float32", "bfloat16", "float16"),
    lora_fp32=True,
    # above the kernels' register-held rank (kernels.MAX_RANK) a session runs the torch LoRA path
    max_rank=None,
    max_moe_rank=None,
    tp=(1, 2, 4, 8),
    cpu_tp=(1, 2, 4, 8),
    per_layer_capture=True,
    bisects=True,
    # packed tokens per forward (TritonOptions.max_batch_tokens); a longer prompt runs alone in its own forward
    prefill_step=8192,
    prefill_step_option=("max_batch_tokens",),
    router_lora="refused",  # LoRA runs on attention and experts only (engines/triton/lora.py SUPPORTED_TARGETS)
    # its kernels are Triton functions even where they run as their torch references; wheels for Linux only
    install="pip install triton==3.6.0 (Linux only: elsewhere run the install self-check, lpdiff run --engine hf)",
    module="triton",
    fp32_twins=({"impl": "torch"}, {}),  # the torch references against the kernels
    modes=(
        Mode("kernels_torch", {"impl": "torch"}),
        Mode("kernels_triton", {"impl": "triton"}, ("triton_kernels",)),
        Mode("attention_sdpa", {"attention": "sdpa"}),
        Mode("attention_flash", {"attention": "flash"}, ("cuda", "low_precision")),
        Mode("attention_triton", {"attention": "triton"}),
    ),
)  # interpreted on CPU, any dtype

__all__ = ["CAPABILITIES", "TritonEngine"]


def __getattr__(name: str):
    """TritonEngine on first use: its kernels import the triton package, and the capabilities above (the install
    command among them) must read where triton is not installed (engines.base.capabilities)."""
    if name == "TritonEngine":
        from lpdiff.engines.triton.engine import TritonEngine

        return TritonEngine
    raise AttributeError(f"module 'lpdiff.engines.triton' has no attribute {name!r}")
