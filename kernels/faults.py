"""The bug zoo: named, opt-in faults that re-create real MoE-LoRA engine bugs inside the triton runtime and its
kernels, so that lpdiff's verdicts and ``lpdiff bisect`` can be shown to catch each of them.

A fault is switched on per engine by ``EngineConfig.options={"fault": NAME}`` or, for any process that opens a
triton engine, by the environment variable ``LPDIFF_FAULT=NAME``; ``resolve`` below is the only place that reads
either. The engine activates it while it is open (and in each tensor-parallel worker) and clears it on close.
Each fault is consulted at the spot where the real bug lived (``on(NAME)`` is a string compare, so the clean path
pays nothing and computes exactly what it computed before the zoo existed).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ENV = "LPDIFF_FAULT"


@dataclass(slots=True, frozen=True)
class Fault:
    name: str
    bug: str  # the real engine bug it re-creates
    where: str  # the spot in our code that it changes
    archs: tuple[str, ...] = ("qwen3_moe", "gpt_oss")  # runtime archs where the buggy code path exists
    # what ``lpdiff bisect`` names for it (harness/commands/bisect.py MODULES): the module on the base weights, or
    # "<module>_lora" (expert_lora for the experts) when only the adapter's delta goes wrong
    module: str = "expert_lora"
    kernel_only: bool = False  # reproduced in kernels/ only (the runtime has no model that reaches it)
    per_arch: tuple[tuple[str, str], ...] = ()  # (arch, module) where the arch names the spot otherwise

    def module_on(self, arch: str) -> str:
        """The module bisect names for this fault on ``arch``."""
        return dict(self.per_arch).get(arch, self.module)


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "lora_rank_layout",
            "an adapter of rank r < max rank R copied into its slot as a flat block, so B (out, r) rows land at "
            "the stride of R: wrong deltas for every lower-rank adapter",
            "engines/triton/lora.py stack_adapters: put()",
        ),
        Fault(
            "gpt_oss_gate_up_concat",
            "gpt-oss expert LoRA-B rows are interleaved (g0 u0 g1 u1 ...) but loaded as if concatenated (gate "
            "then up): the gate delta lands on up columns and back",
            "engines/triton/lora.py stack_adapters: arch.gate_up_rows on the LoRA-B of gate_up",
            archs=("gpt_oss",),
        ),
        Fault(
            "lora_uninitialised",
            "LoRA slot buffers allocated with torch.empty: modules an adapter does not target keep whatever the "
            "allocator's block held, and that garbage is added as a LoRA delta",
            "engines/triton/lora.py stack_adapters: z()",
            module="attention_lora",
        ),  # experts-only adapter's q/k/v/o
        Fault(
            "lora_b_unmasked",
            "the LoRA-B expand of the expert gate_up GEMM without a column mask: for N not a multiple of the block, "
            "the last tile reads B rows of the next expert and stores its overflow into the next row",
            "kernels/moe_reference.py: add_slot_deltas (torch); kernels/lora_gemm.py: the LoRA-B load/store of "
            "_grouped_gemm_kernel",
        ),
        Fault(
            "lora_after_activation",
            "expert gate_up LoRA added after the activation (act(xW) + act(xAB)) instead of inside it (act(xW + xAB))",
            "kernels/moe_reference.py: moe_forward_torch; kernels/lora_gemm.py: _grouped_gemm_kernel epilogue",
        ),
        Fault(
            "topk_weight_twice",
            "the routing weight multiplied into the expert down LoRA delta twice (once in the LoRA kernel, once in "
            "the weighted sum)",
            "kernels/moe_reference.py: moe_forward_torch; kernels/lora_gemm.py: _grouped_gemm_kernel epilogue",
        ),
        Fault(
            "topk_weight_missing",
            "the expert down LoRA delta added to the MoE output without its routing weight",
            "kernels/moe_reference.py: moe_forward_torch; kernels/lora_gemm.py: _grouped_gemm_kernel epilogue",
        ),
        Fault(
            "relu2_as_gated",
            "a non-gated relu^2 MoE (Nemotron-H) run through the gated path: the up projection's I rows read as "
            "gate|up halves (SiLU(first) * second) and the down GEMM over the first I/2 columns",
            "kernels/moe.py moe_forward (both impls), reached by the runtime's Nemotron-H routed experts",
            archs=("nemotron_h",),
            module="experts",
        ),
        Fault(
            "expert_adapter_dropped",
            "a PEFT 3D expert adapter (target_parameters) silently skipped on load (vLLM #41384 on Qwen3.5-MoE): "
            "the experts run as the base model, attention LoRA still applies",
            "engines/triton/lora.py _parse",
        ),
        # Nemotron-H (engines/triton/nemotron_h*.py, mamba.py): the hybrid's own mixers
        Fault(
            "mamba_lora_dropped",
            "LoRA on the Mamba-2 mixer's in_proj/out_proj loaded but never applied (SGLang 0.5.15 keeps LoRA buffers "
            "for in_proj's z and x slices only; an engine without a mamba LoRA path serves the mixer as the base): "
            "attention, MLP and expert LoRA still apply",
            "engines/triton/nemotron_h_weights.py _targets",
            archs=("nemotron_h",),
            module="mamba_lora",
        ),
        Fault(
            "router_bias_rounded",
            "the sigmoid router's e_score_correction_bias rounded before the top-k choice (a low-precision copy of "
            "the fp32 bias); here to 2 decimals, since a bf16 rounding (|error| <= 2.3e-4 on the tiny zoo) changes "
            "no choice there and leaves the output bit-identical (tests/harness/commands/test_hybrid_bug_zoo.py)",
            "engines/triton/nemotron_h_model.py NemotronHModel.route",
            archs=("nemotron_h",),
            module="router",
        ),
        Fault(
            "state_not_reset",
            "the SSD scan's (Nemotron-H) or the gated delta rule's (Qwen3.5) state carried from one prompt of a "
            "packed batch into the next (one sequence over the whole pack instead of a reset at each prompt start)",
            "engines/triton/mamba.py mamba_mixer, engines/triton/qwen3_5.py linear_attention: the scan over the "
            "packed tokens as one row",
            archs=("nemotron_h", "qwen3_5_moe"),
            module="mamba",
            per_arch=(("qwen3_5_moe", "linear_attention"),),
        ),
        Fault(
            "conv_across_prompts",
            "the causal conv1d of the Mamba-2 mixer (or of Qwen3.5's Gated DeltaNet) reading the last conv_kernel - 1 "
            "tokens of the previous prompt of a packed batch (no per-prompt boundary in the conv window)",
            "engines/triton/mamba.py mamba_mixer, engines/triton/qwen3_5.py linear_attention: the conv over the "
            "packed tokens as one row",
            archs=("nemotron_h", "qwen3_5_moe"),
            module="mamba",
            per_arch=(("qwen3_5_moe", "linear_attention"),),
        ),
        Fault(
            "shared_expert_dropped",
            "the MoE's shared expert not added to the routed experts' output (an engine that fuses or skips the "
            "shared expert and loses it)",
            "engines/triton/nemotron_h_model.py NemotronHModel.shared, engines/triton/qwen3_5.py Qwen35Model.shared",
            archs=("nemotron_h", "qwen3_5_moe"),
            module="shared_expert",
        ),
        # Qwen3.5 (engines/triton/qwen3_5*.py, gdn.py): bisect names its Gated DeltaNet layers' mixer linear_attention
        Fault(
            "linear_attention_lora_dropped",
            "LoRA on Qwen3.5's Gated DeltaNet projections (in_proj_qkv/z/b/a, out_proj) loaded but never applied (an "
            "engine whose LoRA path covers q/k/v/o only serves linear attention as the base): full-attention, "
            "shared-expert and expert LoRA still apply",
            "engines/triton/qwen3_5.py Qwen35Model.linear_attention",
            archs=("qwen3_5_moe",),
            module="linear_attention_lora",
        ),
    ]
}

_active: str | None = None


def applicable(name: str, arch: str) -> bool:
    return arch in FAULTS[name].archs


def runtime_faults(arch: str | None = None) -> list[str]:
    """The faults the triton runtime can carry (not kernel-only), those of ``arch`` when given."""
    return [n for n, f in FAULTS.items() if not f.kernel_only and (arch is None or arch in f.archs)]


def resolve(options: dict) -> str | None:
    """The fault an engine with these options runs: the option wins over LPDIFF_FAULT. Unknown names fail."""
    name = options.get("fault") or os.environ.get(ENV) or None
    if name is not None and name not in FAULTS:
        raise ValueError(f"unknown fault {name!r} (option 'fault' or ${ENV}); known: {', '.join(FAULTS)}")
    return name


def activate(name: str | None) -> str | None:
    """Make ``name`` the active fault of this process; returns the previous one (to restore on close)."""
    global _active
    if name is not None and name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    prev, _active = _active, name
    return prev


@contextmanager
def injected(name: str | None):
    """Kernel-level use (tests, bisect): ``with injected("lora_after_activation"): moe_forward(...)``."""
    prev = activate(name)
    try:
        yield
    finally:
        activate(prev)


def active() -> str | None:
    return _active


def on(name: str) -> bool:
    return _active == name


# -- helpers that the faulty code paths share --------------------------------------------------------------------


def stale_empty(*shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty as the buggy engine called it. A CUDA caching allocator hands back a freed block with its old
    contents; on CPU large blocks come fresh from the OS, zero-filled, which would hide the bug by luck. So the
    block is filled with a deterministic stand-in for the previous tenant: values at the scale of activations."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(out.numel())
    out.copy_(torch.randn(*shape, generator=g).mul_(0.5))
    return out


def flat_put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The buggy slot copy: src's elements poured into the front of dst's memory, ignoring that dst's rank
    dimension is wider than src's (correct only when the ranks match)."""
    assert dst.is_contiguous()
    dst.view(-1)[: src.numel()] = src.reshape(-1).to(device=dst.device, dtype=dst.dtype)


LORA_B_BLOCK = 32  # column tile of the unmasked expand (the kernels' CPU/interpreter block_n)


def unmasked_expand(
    out: torch.Tensor, shrink: torch.Tensor, b: torch.Tensor, b_buffer: torch.Tensor, rank: int
) -> None:
    """out (m, N) += shrink (m, rank) @ B^T, as an expand kernel without a column mask does it when N is not a
    multiple of LORA_B_BLOCK: the last tile loads B rows past N (the next rows of ``b_buffer``'s memory: the
    next expert's B) and stores its overflow columns into the following row of ``out`` (the last row's overflow
    lands past the tensor and is lost)."""
    m, n = out.shape
    pad = -n % LORA_B_BLOCK
    flat_b = b_buffer.reshape(-1)
    start = b.storage_offset() - b_buffer.storage_offset()
    R = b.shape[1]
    rows = flat_b[start : start + (n + pad) * R]
    rows = torch.cat([rows, rows.new_zeros((n + pad) * R - rows.numel())]).view(n + pad, R)
    delta = shrink @ rows[:, :rank].float().T  # (m, n + pad)
    flat = out.reshape(-1)
    idx = (torch.arange(m, device=out.device)[:, None] * n + torch.arange(n + pad, device=out.device)).reshape(-1)
    keep = idx < flat.numel()
    flat.index_add_(0, idx[keep], delta.reshape(-1)[keep].to(flat.dtype))
    out.copy_(flat.view(m, n))
