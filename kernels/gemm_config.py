"""Tiles and launch settings of the LoRA GEMM kernels (lora_gemm.py, lora_shrink.py), chosen by small heuristics
instead of autotuning: the interpreter cannot autotune, and tuning per call would cost the runtime a compile storm.
Measured timings: benchmarks/results/kernels.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lpdiff.kernels._triton import next_pow2, triton


@dataclass(slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True  # the epilogue's operands loaded before the K-loop (see _grouped_gemm_kernel)
    tma: bool = False  # expert weight tiles (and the down GEMM's sorted rows) by TMA; see gemm_tma
    n_tiles: int = 1  # consecutive N tiles per program; LORA 1 shrinks on the first only (_grouped_gemm_kernel)
    padding: str = "compute"  # what the padding rows of a group's last block cost; see PADDING
    expand: str = "loop"  # where LORA 2's expand runs; see EXPAND
    n_tail: bool = True  # the last N tile no wider than the columns left (n_tail_width)

    def __post_init__(self):
        for b in (self.block_m, self.block_n, self.block_k):
            assert b >= 16 and b & (b - 1) == 0, f"block sizes must be powers of two >= 16, got {b}"
        assert self.n_tiles >= 1, f"n_tiles must be >= 1, got {self.n_tiles}"
        assert self.padding in PADDING, f"padding must be one of {PADDING}, got {self.padding!r}"
        assert self.expand in EXPAND, f"expand must be one of {EXPAND}, got {self.expand!r}"


# Padding rows (a group's rows rounded up to block_m, ~24 % of the executed rows at Qwen3-30B-A3B's shape, T 4096,
# BLOCK_M 128) never reach the output, but the MMAs still run on them. "compute": they load a real row (no mask);
# "zero": they load zeros (under the H200's 700 W cap the clock falls to ~1.5-1.7 GHz in these GEMMs, and zeros
# cost the tensor cores less energy); "half": "zero", and a group's last block with at most block_m / 2 rows runs
# as a block_m / 2 tile (half its padding never computed; block_m >= 32, as a dot needs 16 rows, else as "zero").
# moe_configs' default (auto_padding): "half", except "zero" for the GEMMs with the shrink in the K-loop (LORA 1),
# whose half-height branch made them slower. Measured on an H200, bf16, full-depth Qwen3-30B-A3B at 8 x 512 tokens
# (benchmarks/results/e2e.md): base calls 69.6k tok/s computed, 72.0k zero, 74.1k half; LoRA calls
# with the shrink in the K-loop 61.8k / 64.1k / 63.2k, with the shrink once 63.0k zero / 64.5k half.
PADDING = ("compute", "zero", "half")


# Where the expert GEMMs' LoRA expand S B^T runs when the shrink comes precomputed (LORA 2), the kernel's EXPAND
# constexpr by index. "last": a dot in the epilogue after the K-loop; "first" (needs prefetch): the accumulator's
# first product, before the K-loop, its S and B tiles loaded outside the pipeline; "loop": the K-loop's first step,
# its tiles loaded by the same pipeline as X and W (pointer loads only: a TMA launch runs "first"). H200, full-depth
# bf16 forward (benchmarks/results/e2e.md): first vs last a tie on Qwen3, +1.7 % on gpt-oss; loop vs first +2.4 %
# on Qwen3's LoRA call (67.0k vs 65.5k tok/s), +0.9 % on gpt-oss.
EXPAND = ("last", "first", "loop")


HALF_TAIL_MIN_M = 32  # a half-height tile must keep the 16 rows a dot needs


def half_tail(cfg: GemmConfig) -> bool:
    """Whether the kernel runs half-used last blocks as half-height tiles (cfg.block_m is the routing block)."""
    return cfg.padding == "half" and cfg.block_m >= HALF_TAIL_MIN_M


def n_tail_width(cfg: GemmConfig, n: int, tma_w: bool, add_to_out: bool) -> int:
    """The width (output columns) the last N tile runs at, the kernel's N_TAIL, or 0 for block_n: the least power of
    two >= the columns past the full tiles, and >= 16 (a dot's least), where that is under block_n. At full tiles
    the last one computes columns that are dropped: gpt-oss's down GEMM (N 2880, 256-wide tiles) 3072 columns and its
    gate_up (128 gated columns a tile) 2944, Nemotron-3-Nano's up (N 1856) 2048 and its down (N 2688) 2816, i.e.
    6.7, 2.2, 10.3 and 4.8 % more MMA work than the output has; at 64, 64, 64 and 128-wide last tiles, none. Not
    with TMA weight tiles (a descriptor's blocks are block_n rows) or add_to_out (the dense layers' delta)."""
    rem = n % cfg.block_n
    if not cfg.n_tail or rem == 0 or tma_w or add_to_out:
        return 0
    width = max(16, next_pow2(rem))
    return width if width < cfg.block_n else 0


def tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte aligned strides, the last one 1."""
    return (
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
    )


def gemm_tma(cfg: GemmConfig, x, w, mode: int, add_to_out: bool, x_sorted: bool) -> tuple[bool, bool]:
    """(W by TMA, X by TMA) for a launch asking cfg.tma. W: without the K-loop shrink (LORA 1, the bug zoo's
    branch) and add_to_out, and when its strides allow a descriptor, else the pointer loads; X: sorted rows only
    (gathered rows are not a block of the tensor), and only beside W, and not with padding "half" (a descriptor's
    blocks are block_m rows; half blocks load block_m / 2). fp32 on the GPU keeps the pointer loads:
    compiled for sm90, its TMA variant came out at 32 registers with ~16 KB of spills per thread (ptxas -v)."""
    tma_w = (
        cfg.tma and mode != 1 and not add_to_out and tma_ok(w) and (w.element_size() == 2 or w.device.type != "cuda")
    )
    return tma_w, tma_w and x_sorted and tma_ok(x) and not half_tail(cfg)


def launch_expand(cfg: GemmConfig, mode: int, num_slices: int, tma_w: bool, add_to_out: bool) -> int:
    """The kernel's EXPAND for a launch: cfg.expand's index, except that "loop" needs the one-slice precomputed
    shrink (LORA 2) with W by pointer loads and a K-loop (not add_to_out); elsewhere it runs "first"."""
    if cfg.expand == "loop" and not (mode == 2 and num_slices == 1 and not tma_w and not add_to_out):
        return EXPAND.index("first")
    return EXPAND.index(cfg.expand)


SMEM_BUDGET = 216 * 1024  # bytes of pipelined tiles per program (Triton reuses them for the epilogue); Hopper: 227 KiB
SMEM_LIMIT = 227 * 1024  # what one block may use on Hopper (sm90)


def routing_block_m(num_pairs: int, num_groups: int) -> int:
    """The routing block of a GPU launch in bf16 (default_config's block_m): it follows the mean rows per (expert,
    adapter slot) group, so padding stays small."""
    rows = num_pairs / max(1, num_groups)
    # 128 from ~100 rows a group: at Qwen3.5's 128 rows (256 experts, T 4096, top-8) it gave 58.3k tokens/s with LoRA
    # against 53.8k at 64, same bits (H200, full depth, benchmarks/results/e2e.md); Super's 176: 33.1k against 30.8k
    return 16 if rows <= 24 else 32 if rows <= 48 else 64 if rows <= 96 else 128


def default_config(
    num_pairs: int,
    num_groups: int,
    n: int,
    kdim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    gated: bool = False,
    rank: int = 0,
    held_rank: int = 0,
    block_m: int | None = None,
) -> GemmConfig:
    """Tiles of one grouped GEMM launch. block_m follows the expected rows per group, so padding stays small; the
    dot is 256 wide for big row blocks (128 x 256 x 64 bf16 tiles were the fastest of those tried on an H100, see
    benchmarks/results/kernels.md); fp32 runs on FMA units and gets smaller tiles; the pipeline depth is
    what fits in shared memory. block_n counts output columns: a gated dot is twice as wide.
    rank: an A tile of that rank per pipeline stage (LORA 1). held_rank: a B tile (held_rank, dot width) that stays
    in shared memory through the K-loop (LORA 2 with the epilogue prefetched; compiled for sm90 it takes
    next_pow2(held_rank) x 256 bf16 beside the stages: 16 KB at rank 32, 64 KB at rank 128). LORA 1 holds its B
    tile too (always loaded before the K-loop); it is kept within SMEM_LIMIT rather than the stage budget, which
    leaves rank 32's 4 stages as they were measured (229376 B compiled for sm90) and gives rank 128 2 stages
    instead of 3 (262144 B, more than a block may have).
    block_m: the routing block instead of the rows heuristic's (a benchmark's variant: fused_moe_lora.MOE_BLOCK_M)."""
    if device.type != "cuda":  # interpreter: small tiles keep the program count and the per-step cost low
        return GemmConfig(block_m or 16, 32, 32, group_m=4, num_warps=4, num_stages=1)
    if block_m is None:
        block_m = routing_block_m(num_pairs, num_groups)
    wn = 256 if block_m >= 64 else 128
    if dtype == torch.float32:
        block_m, wn = min(block_m, 64), 128
    wn = min(wn, max(32, triton.next_power_of_2(n * (2 if gated else 1))))
    block_k = 64
    elem = torch.finfo(dtype).bits // 8
    per_stage = (block_m + wn + (next_pow2(rank) if rank else 0)) * block_k * elem
    held = next_pow2(held_rank) * wn * elem if held_rank else 0
    stages = max(2, min(4, (SMEM_BUDGET - held) // per_stage))
    if rank:
        stages = max(2, min(stages, (SMEM_LIMIT - next_pow2(rank) * wn * elem) // per_stage))
    return GemmConfig(
        block_m,
        wn // 2 if gated else wn,
        block_k,
        group_m=4,
        num_warps=8 if block_m * wn >= 128 * 128 else 4,
        num_stages=stages,
    )


@dataclass(slots=True)
class ShrinkConfig:
    """Launch of _lora_shrink_kernel. rows: rows per program, a divisor of the routing block (programs then
    cover sub-blocks of it: more programs, fewer rows each); 0 = the routing block. block_k: 0 = shrink_block_k's
    choice. Defaults: the best of the sweep on an H200 (bench_kernels --sweep-shrink, bf16, T=4096, rank 32; sum
    over Qwen3 and gpt-oss, gate_up and down: 0.177 ms with 8 warps vs 0.217 with 4, most of it Qwen3's down
    shrink, 0.056 -> 0.032 ms). In the full forward the 96 shrink launches took 3.711 ms with 8 warps vs 3.712 ms
    with 4: the sweep's gain did not carry over, so treat 4 vs 8 as a tie (the sweep times the default first,
    cold)."""

    rows: int = 0
    block_k: int = 0
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for b in (self.rows, self.block_k):
            assert b == 0 or (b >= 16 and b & (b - 1) == 0), f"rows / block_k must be 0 or powers of two >= 16: {b}"

    def resolve(self, route_m: int, block_r: int, dtype: torch.dtype, cuda: bool) -> tuple[int, int]:
        """(rows, block_k) for a routing block of route_m rows."""
        rows = self.rows or route_m
        if route_m % rows:
            raise ValueError(f"ShrinkConfig.rows={rows} must divide the routing block_m={route_m}")
        return rows, self.block_k or shrink_block_k(rows, block_r, dtype, cuda)


def shrink_block_k(block_m: int, block_r: int, dtype: torch.dtype, cuda: bool) -> int:
    """K step of the shrink: long steps (few rows, narrow output) unless 3 stages of fp32 tiles would not fit."""
    if not cuda:
        return 32
    bk = 128
    while bk > 32 and 3 * (block_m + block_r) * bk * torch.finfo(dtype).bits // 8 > SMEM_BUDGET:
        bk //= 2
    return bk
