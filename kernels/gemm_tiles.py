"""Tile-level pieces of the grouped LoRA GEMM (lora_gemm.py): which columns a program's dot covers, its K-loops
(with the shrink or the expand folded in) and the epilogue's operand tiles. Plain @triton.jit functions: called from
an interpreted kernel they run interpreted too (_triton.DualKernel)."""

from __future__ import annotations

from collections import namedtuple

from lpdiff.kernels._triton import tl, triton

# Triton 3.6 takes (named) tuples as kernel and device-function arguments: each element is specialized as a lone
# argument would be (a stride of 1 is a compile-time 1), and a tuple is a compile-time bundle of the same values, so
# the compiled kernel is the one separate arguments give (the PTX of all 82 sm90 launches that bench_kernels
# --compile-sm90 and the dense paths make is identical, debug lines aside). Pointers and tl.constexpr stay kernel
# parameters. The grouped GEMM's strides, one tuple per tensor (its .stride()), in the kernel's argument order:
GemmStrides = namedtuple("GemmStrides", ["x", "w", "bias", "out", "la", "s", "lb"])
# What the K-loops read of one program's N tile: its X rows, padded rows and which of them are real, its first
# padded row, its N tile and W rows, its expert (int64, and int32 for TMA coordinates) and its adapter slot (-1:
# none; clamped to a valid index; the rank mask).
Tile = namedtuple("Tile", ["xrow", "offs_m", "row_ok", "row0", "pid_n", "wrow", "e", "e32", "a", "a_safe", "r_ok"])


@triton.jit
def _s_tile(S, LB, offs_m, offs_r, r_ok, s, R, stride_s, UPCAST: tl.constexpr):
    """LORA 2's S tile of slice s (BLOCK_M, R), rounded to the B dtype right after its load (as LORA 1 rounds its
    in-register shrink; half the registers while it waits)."""
    stride_sm, stride_sr = stride_s
    st = tl.load(
        S + offs_m[:, None].to(tl.int64) * stride_sm + (s * R + offs_r[None, :]) * stride_sr,
        mask=r_ok[None, :],
        other=0.0,
    )
    return st.to(tl.float32) if UPCAST else st.to(LB.dtype.element_ty)


@triton.jit
def _b_tiles(LB, lb_ptrs, r_ok, col, SliceOffs, s, N, stride_lbn, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """LORA 2's B tile (R, WN) of slice s's columns [lo, hi); SPLIT: also the up rows' tile (N rows further), else
    that is the B tile again."""
    lo = tl.load(SliceOffs + s)
    hi = tl.load(SliceOffs + s + 1)
    b_ok = r_ok[:, None] & ((col >= lo) & (col < hi))[None, :]
    bt = tl.load(lb_ptrs, mask=b_ok, other=0.0)
    bu = bt
    if SPLIT:
        bu = tl.load(lb_ptrs + N * stride_lbn, mask=b_ok, other=0.0)
    if UPCAST:
        bt, bu = bt.to(tl.float32), bu.to(tl.float32)
    return bt, bu


@triton.jit
def _bias_rows(Bias, e, wrow, N, stride_b, SPLIT: tl.constexpr):
    """The bias of the program's columns (rows wrow of W) in fp32; SPLIT: also the up rows' (N rows further)."""
    stride_be, stride_bn = stride_b
    bias = tl.load(Bias + e * stride_be + wrow * stride_bn).to(tl.float32)
    bias_up = bias
    if SPLIT:
        bias_up = tl.load(Bias + e * stride_be + (wrow + N) * stride_bn).to(tl.float32)
    return bias, bias_up


@triton.jit
def _acc_start(
    Bias, e, wrow, N, stride_b, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, WN: tl.constexpr
):
    """The accumulator's starting value (acc, acc_up; SPLIT: the up rows', else acc again), (BM, WN) fp32: the bias
    of the program's columns broadcast over its rows, or zeros. The bias is the first term of every variant's sum,
    before any product: added after the K-loop, it would round as (sum) + bias where the loop runs, but Triton's
    combine pass rewrites dot(x, w, 0) + bias into dot(x, w, bias) where a one-step K-loop (Kdim <= BLOCK_K) is
    folded away, so a row would round differently in a launch whose loop is not folded (LORA 2's expand "loop"
    adds steps): on an H200 in fp32, tiny gpt-oss's down GEMM (Kdim 40) moved base rows' expert outputs by up to
    2.4e-7 beside adapter rows. tests/kernels/test_gemm_bias_start.py checks the accumulators compiled for sm90."""
    if HAS_BIAS:
        bias, bias_up = _bias_rows(Bias, e, wrow, N, stride_b, SPLIT)
        acc = tl.broadcast_to(bias[None, :], (BM, WN))  # exact: no add, so a bias of -0.0 stays -0.0
        acc_up = acc
        if SPLIT:
            acc_up = tl.broadcast_to(bias_up[None, :], (BM, WN))
    else:
        acc = tl.zeros((BM, WN), dtype=tl.float32)
        acc_up = acc
    return acc, acc_up


@triton.jit
def _out_tile(offs_m, pair, row_ok, col0, N, stride_o, OUT_SORTED: tl.constexpr, BN: tl.constexpr):
    """Offsets and mask of a program's (BLOCK_M, BN) output tile, its columns from col0: padded rows in place, or
    scattered back to their pair's row."""
    stride_om, stride_on = stride_o
    if OUT_SORTED:
        orow = offs_m
    else:
        orow = pair
    offs_n = col0 + tl.arange(0, BN)
    o_off = orow[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    return o_off, row_ok[:, None] & (offs_n < N)[None, :]


@triton.jit
def _tile_cols(col0, N, INTERLEAVE: tl.constexpr, WN: tl.constexpr):
    """The dot's WN columns of the N tile whose first output column is col0: j, the output column of each, and the
    row of W (and of LoRA B) it reads. INTERLEAVE (gated, no TMA): WN / 2 gate and WN / 2 up rows interleaved (even
    j gate, odd j up), so one MMA of width WN feeds the activation; columns past N wrap to valid rows, so the
    K-loop's loads need no column mask (their results are never stored). Else wrow are the gate rows (SPLIT: the
    up rows N further)."""
    j = tl.arange(0, WN)
    if INTERLEAVE:
        col = col0 + j // 2
        wrow = col % N + (j % 2) * N
    else:
        col = col0 + j
        wrow = col % N
    return j, col, wrow


@triton.jit
def _k_loop_expand(
    acc,
    gemm,
    expand,
    tile,
    Kdim,
    R: tl.constexpr,
    strides,
    K_TILES: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ZERO_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_k_loop for LORA 2 with pointer loads (GemmConfig.expand "loop"): the first cdiv(R, BLOCK_K) steps are the
    LoRA expand (S rows, x dtype, scaled, zero past the loaded rank, against B[a, e] rows wrow; every K column
    masked for a block without an adapter), then the K_TILES steps of acc += X W^T. Each step selects its pointers
    and masks, so one pipelined loop carries both: the expand's loads overlap the K-loop's instead of waiting
    before it. The trip count is a constant: blocks without an adapter multiply zeros in the expand's steps
    instead of skipping them. gemm: (X, W); expand: (S, LB); tile: a Tile; strides: the kernel's GemmStrides."""
    X, W = gemm
    S, LB = expand
    xrow, offs_m, row_ok, wrow, e, a, a_safe = (
        tile.xrow,
        tile.offs_m,
        tile.row_ok,
        tile.wrow,
        tile.e,
        tile.a,
        tile.a_safe,
    )
    stride_xm, stride_xk = strides.x
    stride_we, stride_wn, stride_wk = strides.w
    stride_sm, stride_sr = strides.s
    stride_lbl, stride_lbe, stride_lbn, stride_lbr = strides.lb
    offs_k = tl.arange(0, BLOCK_K)
    # row / column base pointers only (1-D): each step builds its 2-D tiles from them, so no pair of 2-D pointer
    # tensors stays live through the loop (compiled for sm90 that spilled)
    x_rows = X + xrow.to(tl.int64) * stride_xm  # (BLOCK_M,)
    s_rows = S + offs_m.to(tl.int64) * stride_sm
    w_cols = W + e * stride_we + wrow * stride_wn  # (WN,)
    b_cols = LB + a_safe * stride_lbl + e * stride_lbe + wrow * stride_lbn
    R_STEPS: tl.constexpr = (R + BLOCK_K - 1) // BLOCK_K
    for i in range(K_TILES + R_STEPS):
        lora = i < R_STEPS
        kk = tl.where(lora, i, i - R_STEPS) * BLOCK_K + offs_k  # the step's K columns (of S / B, or of X / W)
        if EVEN_K:
            k_ok = offs_k < BLOCK_K
        else:
            k_ok = kk < Kdim
        # S is (M, R): no column past it. B is masked at R, not at the loaded rank: a mask at a loaded (runtime)
        # column along B's contiguous dimension makes its load synchronous (compiled for sm90, the loop lost its
        # pipeline and spilled). The rank still holds: S is exactly zero past it (the shrink masks A there), so
        # finite values past the rank in B add nothing (NaN or inf there would; the runtime stores zeros).
        ok = tl.where(lora, (kk < R) & (a >= 0), k_ok)  # the step's K columns, of X / S and of W / B alike
        # a select of offsets, not of strides: unit strides are compile-time 1, so the columns stay provably
        # contiguous and the loads can be asynchronous copies (a selected stride made W's load synchronous)
        xp = tl.where(lora, s_rows, x_rows)[:, None] + tl.where(lora, kk * stride_sr, kk * stride_xk)[None, :]
        wp = tl.where(lora, b_cols, w_cols)[None, :] + tl.where(lora, kk * stride_lbr, kk * stride_wk)[:, None]
        if ZERO_PAD:
            xt = tl.load(xp, mask=row_ok[:, None] & ok[None, :], other=0.0)
        else:
            xt = tl.load(xp, mask=ok[None, :], other=0.0)
        wt = tl.load(wp, mask=ok[:, None], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _k_loop(
    accs,
    gemm,
    LA,
    tile,
    N,
    Kdim,
    strides,
    SHRINK: tl.constexpr,
    SPLIT: tl.constexpr,
    TMA: tl.constexpr,
    TMA_X: tl.constexpr,
    K_TILES: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ZERO_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One N tile's K-loop: acc (SPLIT: and acc_up, the up rows) += X[rows] W[e, tile]^T. SHRINK (LORA 1, the
    first tile a program walks): also acc_s += X[rows] A[a, e]^T, a narrow dot on the X tile already loaded.
    ZERO_PAD: padding rows load zeros instead of a real row (their results are never stored either way); under a
    power cap the tensor cores spend less energy on zeros (see GemmConfig.padding). accs: (acc, acc_up, acc_s),
    returned updated; gemm: (X, W); tile: a Tile; strides: the kernel's GemmStrides."""
    acc, acc_up, acc_s = accs
    X, W = gemm
    xrow, row_ok, row0, pid_n, wrow = tile.xrow, tile.row_ok, tile.row0, tile.pid_n, tile.wrow
    e, e32, a_safe, r_ok = tile.e, tile.e32, tile.a_safe, tile.r_ok
    stride_xm, stride_xk = strides.x
    stride_we, stride_wn, stride_wk = strides.w
    stride_lal, stride_lae, stride_lar, stride_lak = strides.la
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    if not TMA_X:
        x_ptrs = X + xrow[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    if not TMA:
        w_ptrs = W + e * stride_we + wrow[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if SHRINK:
        la_ptrs = (
            LA + a_safe * stride_lal + e * stride_lae + offs_r[None, :] * stride_lar + offs_k[:, None] * stride_lak
        )
    for k in range(K_TILES):
        if not EVEN_K:
            k_ok = offs_k < Kdim - k * BLOCK_K
        if TMA_X:
            xt = X.load([row0, k * BLOCK_K])
        elif EVEN_K:
            if ZERO_PAD:
                xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                xt = tl.load(x_ptrs)
        elif ZERO_PAD:
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        if TMA:
            wt = tl.reshape(W.load([e32, pid_n * BLOCK_N, k * BLOCK_K]), (BLOCK_N, BLOCK_K)).T
        elif EVEN_K:
            wt = tl.load(w_ptrs)
        else:
            wt = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PREC)
        if SPLIT:
            wu = tl.reshape(W.load([e32, N + pid_n * BLOCK_N, k * BLOCK_K]), (BLOCK_N, BLOCK_K)).T
            acc_up = tl.dot(xt, wu.to(tl.float32) if UPCAST else wu, acc_up, input_precision=DOT_PREC)
        if SHRINK:
            if EVEN_K:
                at = tl.load(la_ptrs, mask=r_ok[None, :], other=0.0)
            else:
                at = tl.load(la_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                at = at.to(tl.float32)
            acc_s = tl.dot(xt, at, acc_s, input_precision=DOT_PREC)
            la_ptrs += BLOCK_K * stride_lak
        if not TMA_X:
            x_ptrs += BLOCK_K * stride_xk
        if not TMA:
            w_ptrs += BLOCK_K * stride_wk
    return acc, acc_up, acc_s
