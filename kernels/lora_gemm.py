"""The grouped GEMM with multi-adapter LoRA that the expert GEMMs (fused_moe_lora.py) and the dense layers'
"triton_delta" / "fused" paths (lora_linear.py) launch: out = act(X W^T + bias + scaling (X A^T) B^T) (* top-k
weight) over rows grouped by (expert, adapter slot) and padded to BLOCK_M (moe_align.py), so each row block has one
expert and one slot and its LoRA A/B are plain tiles. Its torch references are moe_reference.moe_forward_torch and
lora_linear.lora_linear_torch.

The LoRA either comes as A, its shrink run in the K-loop on the X tiles already loaded (LORA 1, where the bug zoo's
kernel faults live), or as a precomputed, scaled S (LORA 2, lora_shrink.py) whose expand is one more dot: before,
in, or after the K-loop (GemmConfig.expand). The epilogue's operands are loaded before the K-loop
(GemmConfig.prefetch); GemmConfig.tma brings weight tiles by TMA; GemmConfig.padding says what padding rows cost.
Dense layers launch it with one expert and a precomputed S, because their per-slice A matrices (q|k|v) would not fit
one fused narrow dot; the "triton_delta" path runs only its epilogue (ADD_TO_OUT: the delta added in place to a
cuBLAS base output).
"""

from __future__ import annotations

import torch

from lpdiff.kernels._triton import device_const, dot_flags, dual_jit, next_pow2, placeholder, tl, triton
from lpdiff.kernels.activation import ACTIVATIONS, GATED, _act, _gated_act
from lpdiff.kernels.gemm_config import GemmConfig, gemm_tma, half_tail, launch_expand, n_tail_width
from lpdiff.kernels.gemm_tiles import (
    GemmStrides,
    Tile,
    _acc_start,
    _b_tiles,
    _k_loop,
    _k_loop_expand,
    _out_tile,
    _s_tile,
    _tile_cols,
)
from lpdiff.kernels.moe_align import MoeRouting

# Bug-zoo faults that live inside the grouped GEMM (kernels/faults.py), by the GEMM they break.
KERNEL_FAULTS = {
    "gate_up": {"lora_after_activation": 1, "lora_b_unmasked": 4},
    "down": {"topk_weight_twice": 2, "topk_weight_missing": 3},
}


@dual_jit
def _grouped_gemm_kernel(
    X,
    W,
    Bias,
    Out,
    LA,
    S,
    LB,
    Scaling,
    Ranks,
    TopkW,
    SortedIds,
    BlockExpert,
    BlockAdapter,
    NumPadded,
    SliceOffs,
    num_pairs,
    N,
    Kdim,
    lb_numel,
    out_numel,
    strides,
    TOPK: tl.constexpr,
    X_SORTED: tl.constexpr,
    OUT_SORTED: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LORA: tl.constexpr,
    MUL_TOPK: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    FAULT: tl.constexpr,
    ADD_TO_OUT: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    TMA: tl.constexpr = False,
    TMA_X: tl.constexpr = False,
    N_TILES: tl.constexpr = 1,
    ZERO_PAD: tl.constexpr = False,
    HALF_TAIL: tl.constexpr = False,
    EXPAND: tl.constexpr = 0,
    N_TAIL: tl.constexpr = 0,
):
    """Out[rows, n] = act(X[rows] W[e, n]^T + bias[e, n] + scaling (X[rows] A[a, e]^T) B[a, e, n]^T) (* topk w).

    strides: a gemm_tiles.GemmStrides, each tensor's strides as one tuple.

    GATED: W rows [0, N) are the gate and [N, 2N) the up projection, interleaved in one dot (_tile_cols).
    LORA: 0 none; 1 the shrink X A^T runs inside the K-loop on the X tiles already loaded (one row block, one
    adapter: A is a plain tile); 2 the shrink comes precomputed and scaled in S (rows of S are padded rows, one
    column block per slice; MoE: one slice (0, N), so gated B rows follow wrow like W's).
    N_TILES: a program walks that many consecutive N tiles of its row block (the row block's last group may be
    short), each with its own K-loop and epilogue; LORA 1 runs its shrink only in the first tile's K-loop and keeps
    the scaled S in registers for the later tiles' expands, so the shrink is redone once per N_TILES tiles instead
    of once per tile.
    FAULT: 0 always, except bug-zoo runs (KERNEL_FAULTS; kernels/faults.py).
    ADD_TO_OUT (dense layers after a cuBLAS base GEMM; LORA 2, K_TILES 0): Out[rows, n] += the LoRA delta in
    place; blocks without an adapter neither read nor write Out.
    HAS_BIAS: the bias is the accumulator's starting value, before any product, in every variant (_acc_start).
    PREFETCH: the epilogue's operands (LORA 2's S and B tiles when there is one slice, the top-k weights) are
    loaded before the K-loop, so that their latency hides behind it instead of stalling every program after its
    last MMA; off, they are loaded where they are used (the A/B in bench_kernels.py).
    TMA (LORA 0 or 2, no ADD_TO_OUT): W is a host tensor descriptor over (E, N_w, Kdim) with blocks
    (1, BLOCK_N, BLOCK_K), its tiles come by TMA (rows or K past the end zero-filled). GATED then loads the gate
    block [n0, n0 + BLOCK_N) and the up block N rows further as two tiles into two accumulators (SPLIT): no
    interleave. TMA_X (X_SORTED only, the rows being contiguous): X is a descriptor too, blocks (BLOCK_M, BLOCK_K).
    ZERO_PAD: padding rows are loaded as zeros (_k_loop). HALF_TAIL: a routing block whose rows past the first half
    are all padding (a group's last block, at most BLOCK_M / 2 rows used) runs as a BLOCK_M / 2 tile: padding rows
    sit at the end of their group, so row BLOCK_M / 2 being padding says it (GemmConfig.padding). N_TAIL (0: off;
    launch_gemm's n_tail_width): the last N tile, whose columns past N would be computed and dropped, runs as an
    N_TAIL-wide tile (output columns; the gated dot twice that).
    EXPAND (LORA 2, one slice; launch_expand): 0 the expand S B^T is a dot in the epilogue; 1 (with PREFETCH) the
    accumulator's first product, before the K-loop; 2 the K-loop's first step, S and B loaded by its pipeline
    (_k_loop_expand; S then has X's dtype)."""
    stride_lbl, stride_lbe, stride_lbn, stride_lbr = strides.lb
    pid = tl.program_id(0)
    num_m = tl.load(NumPadded) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_g = (num_n + N_TILES - 1) // N_TILES  # groups of N_TILES tiles, one per program
    if pid >= num_m * num_g:
        return
    # GROUP_M blocks of rows walk the N tiles together, so a weight tile is read once from DRAM per group
    per_group = GROUP_M * num_g
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    first_n = (pid % per_group) // group_size * N_TILES

    e32 = tl.load(BlockExpert + pid_m)
    e = e32.to(tl.int64)
    a = tl.load(BlockAdapter + pid_m)
    if ADD_TO_OUT:  # noqa: SIM102 - a constexpr if around a runtime one
        if a < 0:
            return  # rows without an adapter keep the cuBLAS output bit for bit
    SPLIT: tl.constexpr = GATED and TMA
    LOOP: tl.constexpr = EXPAND == 2  # the expand as the K-loop's first step (launch_expand says where it can)
    EARLY_S: tl.constexpr = PREFETCH and LORA == 2 and NUM_SLICES == 1 and not LOOP
    FIRST: tl.constexpr = EARLY_S and EXPAND == 1  # the expand before the K-loop
    a_safe = tl.maximum(a, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < 0
    if LORA > 0:
        rank = tl.load(Ranks + a_safe)
        r_ok = (offs_r < rank) & (offs_r < R) & (a >= 0)  # columns past the loaded rank: ignored even if not 0

    # HALF_TAIL: a routing block whose rows past the first half are all padding runs as a BLOCK_M / 2 tile (v 0),
    # every other block as a BLOCK_M tile (v 1): two bodies in one kernel; without HALF_TAIL only the second
    half = False
    if HALF_TAIL:
        half = tl.load(SortedIds + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs
    row0 = pid_m * BLOCK_M
    FIRST_V: tl.constexpr = 0 if HALF_TAIL else 1
    for v in tl.static_range(FIRST_V, 2):
        if half == (v == 0):
            BM: tl.constexpr = BLOCK_M // (2 - v)  # the tile's rows, from row0
            offs_m = row0 + tl.arange(0, BM)
            pair = tl.load(SortedIds + offs_m)
            row_ok = pair < num_pairs
            if X_SORTED:
                xrow = offs_m
            else:
                xrow = tl.minimum(pair, num_pairs - 1) // TOPK  # padding rows: a valid address, never stored
            if MUL_TOPK and PREFETCH:
                tw = tl.load(TopkW + tl.minimum(pair, num_pairs - 1))
            if EARLY_S:  # one S tile per row block, whichever N tiles the program walks
                st = _s_tile(S, LB, offs_m, offs_r, r_ok, 0, R, strides.s, UPCAST)
            else:  # LORA 1: the first tile's shrink replaces it before any expand reads it
                st = tl.zeros((BM, BLOCK_R), dtype=tl.float32)
                if not UPCAST:
                    st = st.to(LB.dtype.element_ty)

            for t in tl.static_range(N_TILES):
                pid_n = first_n + t
                if pid_n < num_n:  # always for t == 0; the row block's last group may be short
                    # N_TAIL: the last N tile runs N_TAIL columns wide (w 0) instead of BLOCK_N (w 1): the columns
                    # past N are never computed; two bodies, as HALF_TAIL for rows
                    narrow = False
                    if N_TAIL > 0:
                        narrow = pid_n == num_n - 1
                    col0 = pid_n * BLOCK_N
                    FIRST_W: tl.constexpr = 0 if N_TAIL > 0 else 1
                    for w in tl.static_range(FIRST_W, 2):
                        if narrow == (w == 0):
                            BN: tl.constexpr = BLOCK_N + (N_TAIL - BLOCK_N) * (1 - w)  # the tile's output columns
                            WNT: tl.constexpr = 2 * BN if GATED and not TMA else BN  # its dot's width
                            j, col, wrow = _tile_cols(col0, N, GATED and not TMA, WNT)
                            lb_ptrs = (
                                LB
                                + a_safe * stride_lbl
                                + e * stride_lbe
                                + offs_r[:, None] * stride_lbr
                                + wrow[None, :] * stride_lbn
                            )
                            # this tile's LoRA B tile, issued before its K-loop so that its latency hides behind it
                            if LORA == 1:
                                # lora_b_unmasked: rows past N unwrapped (next expert's B; the allocation's end holds)
                                if FAULT == 4:
                                    lb_off = (
                                        a_safe * stride_lbl
                                        + e * stride_lbe
                                        + offs_r[:, None] * stride_lbr
                                        + (col + (j % 2) * N if GATED else col)[None, :] * stride_lbn
                                    )
                                    bt = tl.load(LB + lb_off, mask=r_ok[:, None] & (lb_off < lb_numel), other=0.0)
                                else:
                                    bt = tl.load(lb_ptrs, mask=r_ok[:, None], other=0.0)
                            if EARLY_S:
                                bt, bu = _b_tiles(LB, lb_ptrs, r_ok, col, SliceOffs, 0, N, stride_lbn, SPLIT, UPCAST)
                            # ADD_TO_OUT: the accumulator starts from the base output already in Out, the K-loop empty
                            if ADD_TO_OUT:
                                o_off, o_mask = _out_tile(offs_m, pair, row_ok, col0, N, strides.out, OUT_SORTED, BN)
                                acc = tl.load(Out + o_off, mask=o_mask, other=0.0).to(tl.float32)
                                acc_up = acc
                            else:  # SPLIT: acc the gate columns, acc_up the up columns
                                acc, acc_up = _acc_start(Bias, e, wrow, N, strides.bias, HAS_BIAS, SPLIT, BM, WNT)
                            if FIRST:  # noqa: SIM102 - a constexpr if around a runtime one
                                if a >= 0:
                                    acc = tl.dot(st, bt, acc, input_precision=DOT_PREC)
                                    if SPLIT:
                                        acc_up = tl.dot(st, bu, acc_up, input_precision=DOT_PREC)
                            acc_s = tl.zeros((BM, BLOCK_R), dtype=tl.float32)
                            tile = Tile(xrow, offs_m, row_ok, row0, pid_n, wrow, e, e32, a, a_safe, r_ok)
                            if LOOP:
                                acc = _k_loop_expand(
                                    acc,
                                    (X, W),
                                    (S, LB),
                                    tile,
                                    Kdim,
                                    R,
                                    strides,
                                    K_TILES,
                                    EVEN_K,
                                    UPCAST,
                                    DOT_PREC,
                                    ZERO_PAD,
                                    BLOCK_K,
                                )
                            else:
                                acc, acc_up, acc_s = _k_loop(
                                    (acc, acc_up, acc_s),
                                    (X, W),
                                    LA,
                                    tile,
                                    N,
                                    Kdim,
                                    strides,
                                    LORA == 1 and t == 0,
                                    SPLIT,
                                    TMA,
                                    TMA_X,
                                    K_TILES,
                                    EVEN_K,
                                    UPCAST,
                                    DOT_PREC,
                                    ZERO_PAD,
                                    BLOCK_N,
                                    BLOCK_K,
                                    BLOCK_R,
                                )

                            acc_l = tl.zeros((BM, WNT), dtype=tl.float32)  # the LoRA delta kept apart (faults 1-3 only)
                            if LORA == 1 and t == 0:
                                st = acc_s * tl.load(Scaling + a_safe)
                                st = st.to(tl.float32) if UPCAST else st.to(LB.dtype.element_ty)
                            if LORA > 0 and not FIRST and not LOOP:  # noqa: SIM102 - a constexpr if around a runtime one
                                if a >= 0:
                                    if LORA == 1:
                                        bl = bt.to(tl.float32) if UPCAST else bt
                                        if FAULT == 1 or FAULT == 2 or FAULT == 3:
                                            acc_l = tl.dot(st, bl, acc_l, input_precision=DOT_PREC)
                                        else:
                                            acc = tl.dot(st, bl, acc, input_precision=DOT_PREC)
                                    else:
                                        # S holds the slices' shrinks side by side
                                        for s in tl.static_range(NUM_SLICES):
                                            if not EARLY_S:
                                                st = _s_tile(S, LB, offs_m, offs_r, r_ok, s, R, strides.s, UPCAST)
                                                bt, bu = _b_tiles(
                                                    LB, lb_ptrs, r_ok, col, SliceOffs, s, N, stride_lbn, SPLIT, UPCAST
                                                )
                                            acc = tl.dot(st, bt, acc, input_precision=DOT_PREC)
                                            if SPLIT:
                                                acc_up = tl.dot(st, bu, acc_up, input_precision=DOT_PREC)

                            if SPLIT:
                                h = _act(acc, acc_up, ACT)
                            elif GATED:
                                h = _gated_act(acc, ACT, BM, BN)
                                if FAULT == 1:  # lora_after_activation
                                    h += _gated_act(acc_l, ACT, BM, BN)
                            elif ACT == 3:  # relu^2, not gated
                                h = tl.maximum(acc, 0.0)
                                h = h * h
                            else:
                                h = acc
                            if MUL_TOPK:
                                if PREFETCH:
                                    twc = tw[:, None]
                                else:
                                    twc = tl.load(TopkW + tl.minimum(pair, num_pairs - 1))[:, None]
                                h = h * twc
                                if FAULT == 2:  # topk_weight_twice
                                    h += acc_l * twc * twc
                                if FAULT == 3:  # topk_weight_missing
                                    h += acc_l
                            o_off, o_mask = _out_tile(offs_m, pair, row_ok, col0, N, strides.out, OUT_SORTED, BN)
                            # lora_b_unmasked: LoRA blocks store their overflow columns into the next row
                            if FAULT == 4:
                                o_mask = o_mask | (row_ok[:, None] & (a >= 0) & (o_off < out_numel))
                            tl.store(Out + o_off, h.to(Out.dtype.element_ty), mask=o_mask)


def launch_gemm(
    x,
    w,
    out,
    routing: MoeRouting,
    cfg: GemmConfig,
    *,
    x_sorted: bool,
    out_sorted: bool,
    activation: str = "none",
    bias=None,
    lora_a=None,
    lora_s=None,
    lora_b=None,
    scaling=None,
    ranks=None,
    slice_offsets: tuple | None = None,
    topk_weights=None,
    fault: int = 0,
    add_to_out: bool = False,
) -> torch.Tensor:
    """w (E, N_w, Kdim) with N_w = 2N when gated; bias (E, N_w); lora_b viewed as (L, E, N_w, R).
    LoRA either as lora_a (L, E, R, Kdim) (shrink fused into the K-loop) or as a precomputed, scaled lora_s
    (M, S*R) with slice_offsets (dense layers). add_to_out: out already holds x w^T (+ bias); only the
    precomputed LoRA delta is added to it, in place (x and w are not read)."""
    gated = GATED.get(activation, False)
    _, n_w, kdim = w.shape
    n = n_w // 2 if gated else n_w
    mode = 1 if lora_a is not None else 2 if lora_s is not None else 0
    assert not add_to_out or (mode == 2 and not gated and bias is None and topk_weights is None), (
        "add_to_out adds a precomputed lora_s delta only: no activation, bias or top-k weight"
    )
    offs = slice_offsets if slice_offsets is not None else (0, n)
    assert cfg.n_tiles == 1 or (not add_to_out and len(offs) == 2), (
        "n_tiles > 1 is for the expert GEMMs: the dense path (add_to_out, several slices) walks one N tile"
    )
    dummy = routing.sorted_ids
    la = lora_a if mode == 1 else placeholder((1, 1, 1, 1), w.dtype, w.device)
    lb = lora_b if mode else placeholder((1, 1, 1, 1), w.dtype, w.device)
    R = lb.shape[3] if mode else 1
    sv = lora_s if mode == 2 else placeholder((1, 1), torch.float32, w.device)
    grid = (routing.num_blocks * triton.cdiv(triton.cdiv(n, cfg.block_n), cfg.n_tiles),)
    assert not half_tail(cfg) or cfg.block_m == routing.block_m, "padding 'half' halves the routing block"
    tma_w, tma_x = gemm_tma(cfg, x, w, mode, add_to_out, x_sorted)
    expand = launch_expand(cfg, mode, len(offs) - 1, tma_w, add_to_out)
    assert expand != 2 or lora_s.dtype == x.dtype, f"expand 'loop' loads S through X's pointers: S must be {x.dtype}"
    xa, wa = x, w
    if tma_w:
        from triton.tools.tensor_descriptor import TensorDescriptor

        wa = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, cfg.block_n, cfg.block_k])
        if tma_x:
            xa = TensorDescriptor(x, list(x.shape), list(x.stride()), [routing.block_m, cfg.block_k])
    _grouped_gemm_kernel[grid, x.device](
        xa,
        wa,
        bias if bias is not None else dummy,
        out,
        la,
        sv,
        lb,
        scaling if mode else dummy,
        ranks if mode else dummy,
        topk_weights if topk_weights is not None else dummy,
        routing.sorted_ids,
        routing.block_expert,
        routing.block_adapter,
        routing.num_padded,
        device_const(tuple(offs), x.device),
        routing.num_pairs,
        n,
        kdim,
        lb.numel(),
        out.numel(),
        GemmStrides(
            x.stride(),
            w.stride(),
            bias.stride() if bias is not None else (0, 0),
            out.stride(),
            la.stride(),
            sv.stride(),
            lb.stride(),
        ),
        TOPK=routing.top_k,
        X_SORTED=x_sorted,
        OUT_SORTED=out_sorted,
        GATED=gated,
        ACT=ACTIVATIONS[activation],
        HAS_BIAS=bias is not None,
        LORA=mode,
        MUL_TOPK=topk_weights is not None,
        NUM_SLICES=len(offs) - 1,
        R=R,
        BLOCK_M=routing.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_R=next_pow2(R),
        GROUP_M=cfg.group_m,
        K_TILES=0 if add_to_out else triton.cdiv(kdim, cfg.block_k),
        EVEN_K=kdim % cfg.block_k == 0,
        FAULT=fault,
        ADD_TO_OUT=add_to_out,
        PREFETCH=cfg.prefetch,
        TMA=tma_w,
        TMA_X=tma_x,
        N_TILES=cfg.n_tiles,
        ZERO_PAD=cfg.padding != "compute",
        HALF_TAIL=half_tail(cfg),
        EXPAND=expand,
        # the bug zoo's faults are written against full tiles (lora_b_unmasked stores the columns past N)
        N_TAIL=0 if fault else n_tail_width(cfg, n, tma_w, add_to_out),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dot_flags(x.dtype, x.device),
    )
    return out
