"""The MoE expert GEMMs with multi-adapter LoRA on the fused Triton kernel (lora_gemm.py): moe_forward's default
backend.

Shapes: T tokens, K top-k, E experts, H hidden, I expert width, R max rank, L adapter slots, P = T*K (token,
expert) pairs, M padded rows (pairs grouped by (expert, adapter slot), each group padded to BLOCK_M; moe_align.py).

Per layer: alignment (a memset and three small kernels, no host sync), the gate_up GEMM, the down GEMM, and a sum
over the K copies of each token. Each GEMM carries its LoRA expand as one more dot, starts its sum from the bias
(gemm_tiles._acc_start) and its epilogue applies the activation (gate_up) or top-k weight (down). Its shrink X A^T
(lora_shrink "once", the default) is a launch of its own before the GEMM, once per row block, into a (M, R) buffer
S in X's dtype; "fused" runs it as one more narrow dot per K step on the X tile already in shared memory instead:
no launch and no S, but redone by each program of a row block (6 for Qwen3's gate_up, 8 for its down) and its A
tile takes pipeline stages; GemmConfig.n_tiles lets a program walk several N tiles of its row block and shrink only
on the first (the redundancy drops to 1/n_tiles). The bug zoo's kernel faults live in the fused branch. Top-k slots
of a token sit in different groups, so their sum is a separate deterministic reduction rather than atomics (reruns
are bit-identical).
Measured timings and the roofline analysis: benchmarks/results/kernels.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import lpdiff.kernels.faults as faults
from lpdiff.kernels.activation import GATED
from lpdiff.kernels.gemm_config import GemmConfig, ShrinkConfig, default_config
from lpdiff.kernels.lora_gemm import KERNEL_FAULTS, launch_gemm
from lpdiff.kernels.lora_shrink import check_kernel_rank, launch_shrink
from lpdiff.kernels.lora_weights import MoeLoraWeights
from lpdiff.kernels.moe_align import MoeRouting, moe_align
from lpdiff.kernels.moe_inputs import MoeInputs

LORA_SHRINK = ("auto", "once", "fused")
# "auto" = "once". Kernel stage times favoured the shrink in the K-loop ("fused", programs walking several N tiles)
# for Qwen3's shape, but full-depth timed loops on an H200 ranked once (padding half) above it in four of four
# measurements of the LoRA call: 64.5k vs 64.1k, 66.4k vs 65.1k, 66.5k vs 64.8k, 65.3k vs 63.9k tok/s
# (benchmarks/results/e2e.md); gpt-oss (23 and 12 N tiles) was faster with once too. The fused GEMMs run padding
# "zero" where once runs "half" (auto_padding), which the stage times missed.


# moe_configs' GemmConfig.expand (gemm_config.EXPAND). A module constant rather than an engine option:
# benchmarks/bench_e2e.py (--moe-expand) sets it per engine to time the placements in one run.
MOE_EXPAND = "loop"

# The expert GEMMs' routing block (GemmConfig.block_m of both) instead of default_config's rows heuristic; None: the
# heuristic. A module constant for the same reason as MOE_EXPAND: bench_e2e (--moe-block-m) times the choices of one
# model side by side (the heuristic's thresholds were measured at Qwen3's and gpt-oss's rows per expert only).
MOE_BLOCK_M: int | None = None

# GemmConfig.n_tail of both expert GEMMs (the last N tile no wider than the columns left); a module constant for the
# same reason: bench_e2e (--moe-n-tail) times it on and off in one call.
MOE_N_TAIL = True


def auto_padding(lora: MoeLoraWeights | None, once: bool) -> str:
    """moe_configs' GemmConfig.padding: "half", except "zero" for the GEMMs with the shrink in the K-loop (LORA 1),
    whose half-height branch made them slower (gemm_config.PADDING has the numbers)."""
    return "zero" if lora is not None and not once else "half"


def kernel_fault() -> str | None:
    """The active bug-zoo fault when it lives inside the grouped GEMM's fused shrink path (KERNEL_FAULTS)."""
    fault = faults.active()
    return fault if fault in KERNEL_FAULTS["gate_up"] or fault in KERNEL_FAULTS["down"] else None


def check_lora_shrink(lora_shrink: str) -> None:
    if lora_shrink not in LORA_SHRINK:
        raise ValueError(f"lora_shrink must be one of {LORA_SHRINK}, got {lora_shrink!r}")


def resolve_lora_shrink(lora_shrink: str) -> str:
    """ "auto" -> the mode it stands for ("once"); other modes come back as given."""
    check_lora_shrink(lora_shrink)
    return "once" if lora_shrink == "auto" else lora_shrink


def shrink_once(lora: MoeLoraWeights | None, lora_shrink: str) -> bool:
    """Whether the expert GEMMs get their shrink precomputed (LORA 2); a bug-zoo kernel fault forces the fused
    shrink (LORA 1), the branch where those faults live."""
    return lora is not None and resolve_lora_shrink(lora_shrink) == "once" and kernel_fault() is None


def moe_configs(
    moe: MoeInputs, once: bool, device: torch.device | None = None, **flags
) -> tuple[GemmConfig, GemmConfig]:
    """Default tiles of the gate_up and down GEMMs. The LoRA A tile takes pipeline stages only when the shrink
    runs in the K-loop; precomputed (once), the GEMMs get the stage count of the no-LoRA path unless a B tile
    prefetched outside the pipeline (expand "first" / "last") leaves room for fewer (rank 64 and up at 128 x 256 x
    64 bf16 tiles: 3 stages instead of 4).
    padding: auto_padding's unless flags say. flags: GemmConfig fields to change in both (prefetch=False for the
    A/B of the epilogue loads). device: the device to pick tiles for, if not x's (bench_kernels --compile-sm90
    builds GPU launches on meta tensors)."""
    x, lora = moe.x, moe.lora
    device = device or x.device
    T, H = x.shape
    n1 = moe.w_gate_up.shape[1]
    gated = GATED[moe.activation]
    inter_n = n1 // 2 if gated else n1
    pairs = T * moe.topk_ids.shape[1]
    # rows spread over (expert, slot) groups; used slots are not known without a sync
    groups = moe.w_gate_up.shape[0] * max(1, lora.num_slots if lora is not None else 0)
    stage_rank = lora.max_rank if lora is not None and not once else 0
    defaults: dict[str, Any] = dict(padding=auto_padding(lora, once), expand=MOE_EXPAND, n_tail=MOE_N_TAIL)
    flags = defaults | flags
    # the expand "loop" brings B through the pipeline's own buffers (a TMA launch runs "first" instead)
    in_loop = flags["expand"] == "loop" and not flags.get("tma", False)
    held_rank = lora.max_rank if lora is not None and once and flags.get("prefetch", True) and not in_loop else 0
    bm = MOE_BLOCK_M
    return (
        replace(default_config(pairs, groups, inter_n, H, device, x.dtype, gated, stage_rank, held_rank, bm), **flags),
        replace(default_config(pairs, groups, H, inter_n, device, x.dtype, False, stage_rank, held_rank, bm), **flags),
    )


def expert_shrink(
    inp: torch.Tensor, lora: MoeLoraWeights, gemm: str, routing: MoeRouting, cfg: ShrinkConfig | None = None
) -> torch.Tensor:
    """The scaled shrink of one expert GEMM ("gate_up": x gathered by pair // top_k; "down": the sorted
    intermediate) over every routed row, once per row block: (M, R) in inp's dtype, the rounding every expand
    placement applies before its dot (expand "loop" loads it through X's pointers)."""
    a = getattr(lora, f"{gemm}_a")
    return launch_shrink(
        inp, a.unsqueeze(2), lora.scaling, lora.ranks, routing, x_sorted=gemm == "down", cfg=cfg, dtype=inp.dtype
    )


def expert_lora_kwargs(lora: MoeLoraWeights | None, gemm: str, s: torch.Tensor | None) -> dict:
    """launch_gemm's LoRA arguments of one expert GEMM: the precomputed shrink s (LORA 2: only the expand in the
    epilogue) or, s None, A for the shrink fused into the K-loop (LORA 1, where the bug zoo's kernel faults live)."""
    if lora is None:
        return {}
    kw = dict(lora_b=getattr(lora, f"{gemm}_b"), scaling=lora.scaling, ranks=lora.ranks)
    if s is not None:
        return dict(kw, lora_s=s)
    active = faults.active()
    fault = 0 if active is None else KERNEL_FAULTS[gemm].get(active, 0)
    return dict(kw, lora_a=getattr(lora, f"{gemm}_a"), fault=fault)


def moe_forward_triton(
    moe: MoeInputs,
    config: GemmConfig | None = None,
    down_config: GemmConfig | None = None,
    lora_shrink: str = "auto",
    sum_topk: bool = True,
    shrink_config: ShrinkConfig | None = None,
    n_tiles: int | tuple[int, int] | None = None,
    padding: str | None = None,
) -> torch.Tensor:
    """lora_shrink: "once" computes each GEMM's shrink X A^T in its own launch, once per row block (the GEMM's
    N/BLOCK_N programs of a row block would each redo it), launched as shrink_config says (default ShrinkConfig());
    "fused" runs it inside every program's K-loop (no launch and no S buffer). A bug-zoo kernel fault forces
    "fused": the faults live in that branch. "auto" (default): "once" (LORA_SHRINK; measurements there).
    n_tiles: GemmConfig.n_tiles of both GEMMs, or (gate_up's, down's) (each program walks that many N tiles of its
    row block; "fused" then redoes the shrink once per n_tiles tiles); None keeps the configs' own (default 1).
    Compiled for sm90 at rank 32 no variant spills; at rank 128 the S tile held in registers across tiles does
    (4-96 B per thread at 2 tiles).
    padding: GemmConfig.padding of both GEMMs (PADDING); None keeps the configs' own (default configs: auto_padding).
    sum_topk False: return the (T, K, H) weighted per-pair outputs unsummed, for a caller that fuses the sum into
    its next pass (the runtime's residual add + RMSNorm)."""
    x, lora = moe.x, moe.lora
    check_kernel_rank(lora.max_rank if lora is not None else 0)
    T, H = x.shape
    E, n1, _ = moe.w_gate_up.shape
    K = moe.topk_ids.shape[1]
    inter_n = n1 // 2 if GATED[moe.activation] else n1
    once = shrink_once(lora, lora_shrink)
    cfg1, cfg2 = moe_configs(moe, once)
    cfg1, cfg2 = config or cfg1, down_config or cfg2
    if n_tiles is not None:
        t1, t2 = (n_tiles, n_tiles) if isinstance(n_tiles, int) else n_tiles
        cfg1, cfg2 = replace(cfg1, n_tiles=t1), replace(cfg2, n_tiles=t2)
    if padding is not None:
        cfg1, cfg2 = replace(cfg1, padding=padding), replace(cfg2, padding=padding)
    assert cfg2.block_m == cfg1.block_m, "both GEMMs share one alignment, so block_m must match"
    routing = moe_align(
        moe.topk_ids, moe.slots, E, lora.num_slots if lora is not None else 0, cfg1.block_m, impl="triton"
    )
    inter = torch.empty(routing.sorted_ids.shape[0], inter_n, dtype=x.dtype, device=x.device)
    s1 = expert_shrink(x, lora, "gate_up", routing, shrink_config) if once and lora is not None else None
    launch_gemm(
        x,
        moe.w_gate_up,
        inter,
        routing,
        cfg1,
        x_sorted=False,
        out_sorted=True,
        activation=moe.activation,
        bias=moe.b_gate_up,
        **expert_lora_kwargs(lora, "gate_up", s1),
    )
    del s1  # its memory can serve s2
    s2 = expert_shrink(inter, lora, "down", routing, shrink_config) if once and lora is not None else None
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    launch_gemm(
        inter,
        moe.w_down,
        y,
        routing,
        cfg2,
        x_sorted=True,
        out_sorted=False,
        bias=moe.b_down,
        topk_weights=moe.topk_weights.reshape(-1).float(),
        **expert_lora_kwargs(lora, "down", s2),
    )
    if not sum_topk:
        return y.view(T, K, H)
    return y.view(T, K, H).sum(dim=1) if K > 1 else y
