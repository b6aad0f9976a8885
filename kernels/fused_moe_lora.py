"""Fused MoE expert GEMMs with multi-adapter LoRA: Triton kernels, their launcher and the torch reference.

Shapes: T tokens, K top-k, E experts, H hidden, I expert width, R max rank, L adapter slots, N output width of one
GEMM (N1 = 2I gated or I non-gated for gate_up, H for down), P = T*K (token, expert) pairs, M padded rows
(pairs grouped by (expert, adapter slot), each group padded to BLOCK_M; see moe_align.py), S slices.

Per layer the Triton path launches: alignment (a memset and three small kernels, no host sync), the gate_up
GEMM, the down GEMM, and a sum over the K copies of each token. Each GEMM carries its LoRA expand as one more dot
(the K-loop's first step, or with the shrink in the K-loop after it in the epilogue; EXPAND), and its epilogue
adds bias, activation (gate_up) or top-k weight (down). Its shrink X A^T (lora_shrink="once", the default) is a
launch of its own before the GEMM, once per row block, into a (M, R) buffer S in X's dtype; "fused" runs it
as one more narrow dot per K step on the X tile already in shared memory instead: no launch and no S, but redone
by each program of a row block (6 for Qwen3's gate_up, 8 for its down) and its A tile takes pipeline stages;
GemmConfig.n_tiles lets a program walk several N tiles of its row block and shrink only on the first, keeping S in
registers for the others' expands (the redundancy drops to 1/n_tiles). The bug zoo's kernel faults live in the
fused branch. Top-k slots of a token sit in different groups, so their sum is a separate deterministic reduction
rather than atomics (reruns are bit-identical).
Padding rows (each group rounded up to BLOCK_M) load zeros, and a group's last block with at most half its rows
used runs as a half-height tile (GemmConfig.padding, PADDING): the GPU is at its power cap here, so work thrown away
still costs time.
The epilogue's operands (S and B tiles, bias, top-k weights) are loaded before the K-loop (GemmConfig.prefetch);
GemmConfig.tma (off by default, exploratory) brings the expert weight tiles, and the down GEMM's sorted rows, by
TMA through host tensor descriptors; ShrinkConfig sets the shrink's launch (rows per program, K step, warps, stages).
Dense layers (lora_linear.py) use the same GEMM with one expert and a precomputed shrink (_lora_shrink_kernel),
because their per-slice A matrices (q|k|v) would not fit one fused narrow dot; by default they run only its
epilogue (ADD_TO_OUT: the LoRA delta added in place to a cuBLAS base output).
Measured timings and the roofline analysis: benchmarks/results/kernels_notes.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lpdiff.kernels import faults
from lpdiff.kernels._triton import dot_flags, dual_jit, next_pow2, resolve_impl, tl, triton
from lpdiff.kernels.moe_align import MoeRouting, moe_align

ACTIVATIONS = {"none": 0, "silu": 1, "swiglu_oai": 2, "relu2": 3}
GATED = {"silu": True, "swiglu_oai": True, "relu2": False}
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


@dataclass(slots=True)
class MoeLoraWeights:
    """One layer's expert LoRA for L adapter slots, zero-padded to max rank R."""
    gate_up_a: torch.Tensor  # (L, E, R, H)   may be expand()ed with stride 0 on E (shared-outer layout)
    gate_up_b: torch.Tensor  # (L, E, N1, R)  N1 = 2I (gated) or I; rows in kernel layout (gate then up)
    down_a: torch.Tensor     # (L, E, R, I)
    down_b: torch.Tensor     # (L, E, H, R)   may be stride 0 on E (shared-outer)
    scaling: torch.Tensor    # (L,) float32 alpha/r per slot
    ranks: torch.Tensor      # (L,) int32 loaded rank per slot (<= R); columns past it are ignored

    def __post_init__(self):
        L, E, R, H = self.gate_up_a.shape
        N1 = self.gate_up_b.shape[2]
        I = self.down_a.shape[3]
        assert self.gate_up_b.shape == (L, E, N1, R), f"gate_up_b {tuple(self.gate_up_b.shape)} != (L,E,N1,R)"
        assert self.down_a.shape == (L, E, R, I), f"down_a {tuple(self.down_a.shape)} != {(L, E, R, I)}"
        assert self.down_b.shape == (L, E, H, R), f"down_b {tuple(self.down_b.shape)} != {(L, E, H, R)}"
        assert self.scaling.shape == (L,) and self.scaling.dtype == torch.float32, "scaling must be (L,) float32"
        assert self.ranks.shape == (L,), "ranks must be (L,) int (loaded rank of each slot)"

    @property
    def num_slots(self) -> int:
        return self.gate_up_a.shape[0]

    @property
    def max_rank(self) -> int:
        return self.gate_up_a.shape[2]


# ----------------------------------------------------------------------------------------------------------------
# torch reference: loops over experts and adapter slots, fp32 math, the activation rounded to x.dtype like the
# kernel's intermediate buffer.

def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu2":
        return torch.relu(h).square()
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=OAI_LIMIT), up.clamp(min=-OAI_LIMIT, max=OAI_LIMIT)
        return (up + 1) * gate * torch.sigmoid(OAI_ALPHA * gate)
    raise ValueError(f"unknown activation {activation!r}; use one of {sorted(GATED)}")


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling, rank: int) -> torch.Tensor:
    """scaling * (x A[:rank]^T) B[:, :rank]^T in fp32; x (m, in), a (R, in), b (out, R)."""
    return float(scaling) * (x.float() @ a[:rank].float().T) @ b[:, :rank].float().T


def add_slot_deltas(out: torch.Tensor, inp: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    lora: MoeLoraWeights, unmasked_b: torch.Tensor | None = None) -> None:
    """out[rows of slot s] += LoRA delta of slot s for every slot used (-1 rows get none); a (L, R, in),
    b (L, out, R) of one expert. ``unmasked_b`` (fault lora_b_unmasked only): the whole stacked B buffer that an
    expand without a column mask reads past this expert's rows."""
    for s in slots.unique().tolist():
        if s >= 0:
            rows = slots == s
            rank = int(lora.ranks[s])
            if unmasked_b is None:
                out[rows] += lora_delta(inp[rows], a[s], b[s], lora.scaling[s], rank)
                continue
            sub = out[rows]
            shrink = float(lora.scaling[s]) * (inp[rows].float() @ a[s][:rank].float().T)
            faults.unmasked_expand(sub, shrink, b[s], unmasked_b, rank)
            out[rows] = sub


def moe_forward_torch(x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up=None, b_down=None,
                      lora: MoeLoraWeights | None = None, token_adapter=None) -> torch.Tensor:
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    slots = token_adapter.long() if lora is not None else torch.full((T,), -1, device=x.device)
    fault = faults.active() if lora is not None else None
    for e in range(w_gate_up.shape[0]):
        t_idx, k_idx = (topk_ids == e).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        xe = x[t_idx].float()
        h = xe @ w_gate_up[e].float().T
        if b_gate_up is not None:
            h += b_gate_up[e].float()
        # the zoo's faults on the LoRA path keep the delta apart where the buggy engine did (kernels/faults.py)
        hd = torch.zeros_like(h) if fault == "lora_after_activation" else h
        if lora is not None:
            add_slot_deltas(hd, xe, slots[t_idx], lora.gate_up_a[:, e], lora.gate_up_b[:, e], lora,
                            lora.gate_up_b if fault == "lora_b_unmasked" else None)
        act = activate(h, activation)
        if hd is not h:
            act = act + activate(hd, activation)
        act = act.to(x.dtype).float()
        y = act @ w_down[e].float().T
        if b_down is not None:
            y += b_down[e].float()
        weight = topk_weights[t_idx, k_idx, None].float()
        yd = torch.zeros_like(y) if fault in ("topk_weight_twice", "topk_weight_missing") else y
        if lora is not None:
            add_slot_deltas(yd, act, slots[t_idx], lora.down_a[:, e], lora.down_b[:, e], lora)
        if yd is not y:
            y = y + yd * (weight if fault == "topk_weight_twice" else 1.0 / weight)
        out.index_add_(0, t_idx, y * weight)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels. Rows of a block share one expert and one adapter slot (moe_align), so LoRA A/B are plain tiles.

@dual_jit
def _lora_shrink_kernel(
        X, A, S, Scaling, Ranks, SortedIds, BlockExpert, BlockAdapter, NumPadded,
        num_pairs, Kdim,
        stride_xm, stride_xk, stride_al, stride_ae, stride_as, stride_ar, stride_ak, stride_sm, stride_sr,
        TOPK: tl.constexpr, X_SORTED: tl.constexpr, R: tl.constexpr, ROUTE_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """S[row, s*R : s*R+R] = scaling[a] * X[row] A[a, e, s]^T for every padded row of blocks with an adapter.
    A program covers BLOCK_M rows, a sub-block of a routing block of ROUTE_M rows (one expert, one slot)."""
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    blk = pid // (ROUTE_M // BLOCK_M)
    if blk * ROUTE_M >= tl.load(NumPadded):
        return
    a = tl.load(BlockAdapter + blk)
    if a < 0:
        return  # the expand skips these blocks too, so S rows stay unwritten
    e = tl.load(BlockExpert + blk)
    rank = tl.load(Ranks + a)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # sub-blocks of one block are consecutive programs
    if tl.load(SortedIds + pid * BLOCK_M) >= num_pairs:
        return  # all padding (it sits at the end of its group): no expand reads these rows
    pair = tl.load(SortedIds + offs_m)
    row_ok = pair < num_pairs
    if X_SORTED:
        xrow = offs_m
    else:
        xrow = tl.minimum(pair, num_pairs - 1) // TOPK  # padding rows: a valid address, loaded as zeros
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = (offs_r < rank) & (offs_r < R)  # columns past the loaded rank are ignored even if not zero
    x_ptrs = X + xrow[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = (A + a.to(tl.int64) * stride_al + e.to(tl.int64) * stride_ae + sl * stride_as
              + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak)
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k in range(0, K_TILES):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < Kdim - k * BLOCK_K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    acc = acc * tl.load(Scaling + a)
    s_ptrs = S + offs_m[:, None].to(tl.int64) * stride_sm + (sl * R + offs_r[None, :]) * stride_sr
    tl.store(s_ptrs, acc, mask=offs_r[None, :] < R)


@triton.jit
def _gated_act(acc, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Interleaved (gate, up) columns of acc -> the gated activation (BLOCK_M, BLOCK_N)."""
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    return _act(gate, up, ACT)


@triton.jit
def _act(gate, up, ACT: tl.constexpr):
    """The gated activation of same-shape gate and up tiles."""
    if ACT == 1:  # SiLU-gated
        h = gate / (1.0 + tl.exp(-gate)) * up
    else:  # gpt-oss clamped SwiGLU
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        h = (up + 1.0) * gate / (1.0 + tl.exp(-1.702 * gate))
    return h


@triton.jit
def _s_tile(S, LB, offs_m, offs_r, r_ok, s, R, stride_sm, stride_sr, UPCAST: tl.constexpr):
    """LORA 2's S tile of slice s (BLOCK_M, R), rounded to the B dtype right after its load (as LORA 1 rounds its
    in-register shrink; half the registers while it waits)."""
    st = tl.load(S + offs_m[:, None].to(tl.int64) * stride_sm + (s * R + offs_r[None, :]) * stride_sr,
                 mask=r_ok[None, :], other=0.0)
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
def _bias_rows(Bias, e, wrow, N, stride_be, stride_bn, SPLIT: tl.constexpr):
    """The bias of the program's columns (rows wrow of W) in fp32; SPLIT: also the up rows' (N rows further)."""
    bias = tl.load(Bias + e * stride_be + wrow * stride_bn).to(tl.float32)
    bias_up = bias
    if SPLIT:
        bias_up = tl.load(Bias + e * stride_be + (wrow + N) * stride_bn).to(tl.float32)
    return bias, bias_up


@triton.jit
def _out_tile(offs_m, pair, row_ok, pid_n, N, stride_om, stride_on, OUT_SORTED: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Offsets and mask of a program's (BLOCK_M, BLOCK_N) output tile: padded rows in place, or scattered back
    to their pair's row."""
    if OUT_SORTED:
        orow = offs_m
    else:
        orow = pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_off = orow[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    return o_off, row_ok[:, None] & (offs_n < N)[None, :]


@triton.jit
def _tile_cols(pid_n, N, INTERLEAVE: tl.constexpr, BLOCK_N: tl.constexpr, WN: tl.constexpr):
    """The dot's WN columns of N tile pid_n: j, the output column of each, and the row of W (and of LoRA B) it
    reads. INTERLEAVE (gated, no TMA): BLOCK_N gate and BLOCK_N up rows interleaved (even j gate, odd j up), so
    one MMA of width 2*BLOCK_N feeds the activation; columns past N wrap to valid rows, so the K-loop's loads need
    no column mask (their results are never stored). Else wrow are the gate rows (SPLIT: the up rows N further)."""
    j = tl.arange(0, WN)
    if INTERLEAVE:
        col = pid_n * BLOCK_N + j // 2
        wrow = col % N + (j % 2) * N
    else:
        col = pid_n * BLOCK_N + j
        wrow = col % N
    return j, col, wrow


@triton.jit
def _k_loop_expand(X, W, S, LB, acc, xrow, offs_m, row_ok, wrow, e, a, a_safe, Kdim, R,
                   stride_xm, stride_xk, stride_wn, stride_we, stride_wk, stride_sm, stride_sr,
                   stride_lbl, stride_lbe, stride_lbn, stride_lbr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, ZERO_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """_k_loop for LORA 2 with pointer loads (GemmConfig.expand "loop"): the first cdiv(R, BLOCK_K) steps are the
    LoRA expand (S rows, x dtype, scaled, zero past the loaded rank, against B[a, e] rows wrow; every K column
    masked for a block without an adapter), then the K_TILES steps of acc += X W^T. Each step selects its pointers
    and masks, so one pipelined loop carries both: the expand's loads overlap the K-loop's instead of waiting
    before it. The trip count is a constant: blocks without an adapter multiply zeros in the expand's steps
    instead of skipping them."""
    offs_k = tl.arange(0, BLOCK_K)
    # row / column base pointers only (1-D): each step builds its 2-D tiles from them, so no pair of 2-D pointer
    # tensors stays live through the loop (compiled for sm90 that spilled)
    x_rows = X + xrow.to(tl.int64) * stride_xm  # (BLOCK_M,)
    s_rows = S + offs_m.to(tl.int64) * stride_sm
    w_cols = W + e * stride_we + wrow * stride_wn  # (WN,)
    b_cols = LB + a_safe * stride_lbl + e * stride_lbe + wrow * stride_lbn
    R_STEPS: tl.constexpr = (R + BLOCK_K - 1) // BLOCK_K
    for i in range(0, K_TILES + R_STEPS):
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
def _k_loop(X, W, LA, acc, acc_up, acc_s, xrow, row_ok, wrow, e, e32, a_safe, row0, pid_n, N, Kdim, r_ok,
            stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_lal, stride_lae, stride_lar, stride_lak,
            SHRINK: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, TMA_X: tl.constexpr,
            K_TILES: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
            ZERO_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """One N tile's K-loop: acc (SPLIT: and acc_up, the up rows) += X[rows] W[e, tile]^T. SHRINK (LORA 1, the
    first tile a program walks): also acc_s += X[rows] A[a, e]^T, a narrow dot on the X tile already loaded.
    ZERO_PAD: padding rows load zeros instead of a real row (their results are never stored either way); under a
    power cap the tensor cores spend less energy on zeros (see GemmConfig.padding)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    if not TMA_X:
        x_ptrs = X + xrow[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    if not TMA:
        w_ptrs = W + e * stride_we + wrow[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if SHRINK:
        la_ptrs = (LA + a_safe * stride_lal + e * stride_lae + offs_r[None, :] * stride_lar
                   + offs_k[:, None] * stride_lak)
    for k in range(0, K_TILES):
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


# Bug-zoo faults that live inside the grouped GEMM (kernels/faults.py), by the GEMM they break.
KERNEL_FAULTS = {"gate_up": {"lora_after_activation": 1, "lora_b_unmasked": 4},
                 "down": {"topk_weight_twice": 2, "topk_weight_missing": 3}}


@dual_jit
def _grouped_gemm_kernel(
        X, W, Bias, Out, LA, S, LB, Scaling, Ranks, TopkW, SortedIds, BlockExpert, BlockAdapter, NumPadded,
        SliceOffs, num_pairs, N, Kdim, lb_numel, out_numel,
        stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om, stride_on,
        stride_lal, stride_lae, stride_lar, stride_lak, stride_sm, stride_sr,
        stride_lbl, stride_lbe, stride_lbn, stride_lbr,
        TOPK: tl.constexpr, X_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, GATED: tl.constexpr,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, MUL_TOPK: tl.constexpr,
        NUM_SLICES: tl.constexpr, R: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        GROUP_M: tl.constexpr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr, FAULT: tl.constexpr, ADD_TO_OUT: tl.constexpr = False,
        PREFETCH: tl.constexpr = False, TMA: tl.constexpr = False, TMA_X: tl.constexpr = False,
        N_TILES: tl.constexpr = 1, ZERO_PAD: tl.constexpr = False, HALF_TAIL: tl.constexpr = False,
        EXPAND: tl.constexpr = 0):
    """Out[rows, n] = act(X[rows] W[e, n]^T + bias[e, n] + scaling (X[rows] A[a, e]^T) B[a, e, n]^T) (* topk w).

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
    PREFETCH: the epilogue's operands (LORA 2's S and B tiles when there is one slice, the bias unless LORA 1
    walks several tiles, the top-k weights) are loaded before the K-loop, so that their latency hides behind it
    instead of stalling every program after its last MMA; off, they are loaded where they are used (the A/B in
    bench_kernels.py).
    TMA (LORA 0 or 2, no ADD_TO_OUT): W is a host tensor descriptor over (E, N_w, Kdim) with blocks
    (1, BLOCK_N, BLOCK_K), its tiles come by TMA (rows or K past the end zero-filled). GATED then loads the gate
    block [n0, n0 + BLOCK_N) and the up block N rows further as two tiles into two accumulators (SPLIT): no
    interleave. TMA_X (X_SORTED only, the rows being contiguous): X is a descriptor too, blocks (BLOCK_M, BLOCK_K).
    ZERO_PAD: padding rows are loaded as zeros (_k_loop). HALF_TAIL: a routing block whose rows past the first half
    are all padding (a group's last block, at most BLOCK_M / 2 rows used) runs as a BLOCK_M / 2 tile: padding rows
    sit at the end of their group, so row BLOCK_M / 2 being padding says it (GemmConfig.padding).
    EXPAND (LORA 2, one slice; launch_expand): 0 the expand S B^T is a dot in the epilogue; 1 (with PREFETCH) the
    accumulator's first product, before the K-loop; 2 the K-loop's first step, S and B loaded by its pipeline
    (_k_loop_expand; S then has X's dtype)."""
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
    if ADD_TO_OUT:
        if a < 0:
            return  # rows without an adapter keep the cuBLAS output bit for bit
    if HALF_TAIL:  # a constexpr branch: without it the kernel compiles one row-block body, as before
        if tl.load(SortedIds + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs:
            _row_block(X, W, Bias, Out, LA, S, LB, Scaling, Ranks, TopkW, SortedIds, SliceOffs, num_pairs, N, Kdim,
                       lb_numel, out_numel, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
                       stride_om, stride_on, stride_lal, stride_lae, stride_lar, stride_lak, stride_sm, stride_sr,
                       stride_lbl, stride_lbe, stride_lbn, stride_lbr, e, e32, a, pid_m * BLOCK_M, first_n, num_n,
                       TOPK, X_SORTED, OUT_SORTED, GATED, ACT, HAS_BIAS, LORA, MUL_TOPK, NUM_SLICES, R, BLOCK_M // 2,
                       BLOCK_N, BLOCK_K, BLOCK_R, K_TILES, EVEN_K, DOT_PREC, UPCAST, FAULT, ADD_TO_OUT, PREFETCH, TMA,
                       TMA_X, N_TILES, ZERO_PAD, EXPAND)
            return
    _row_block(X, W, Bias, Out, LA, S, LB, Scaling, Ranks, TopkW, SortedIds, SliceOffs, num_pairs, N, Kdim,
               lb_numel, out_numel, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
               stride_om, stride_on, stride_lal, stride_lae, stride_lar, stride_lak, stride_sm, stride_sr,
               stride_lbl, stride_lbe, stride_lbn, stride_lbr, e, e32, a, pid_m * BLOCK_M, first_n, num_n,
               TOPK, X_SORTED, OUT_SORTED, GATED, ACT, HAS_BIAS, LORA, MUL_TOPK, NUM_SLICES, R, BLOCK_M,
               BLOCK_N, BLOCK_K, BLOCK_R, K_TILES, EVEN_K, DOT_PREC, UPCAST, FAULT, ADD_TO_OUT, PREFETCH, TMA,
               TMA_X, N_TILES, ZERO_PAD, EXPAND)


@triton.jit
def _row_block(X, W, Bias, Out, LA, S, LB, Scaling, Ranks, TopkW, SortedIds, SliceOffs, num_pairs, N, Kdim,
               lb_numel, out_numel, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
               stride_om, stride_on, stride_lal, stride_lae, stride_lar, stride_lak, stride_sm, stride_sr,
               stride_lbl, stride_lbe, stride_lbn, stride_lbr, e, e32, a, row0, first_n, num_n,
               TOPK: tl.constexpr, X_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, GATED: tl.constexpr,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, MUL_TOPK: tl.constexpr,
               NUM_SLICES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr,
               DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, FAULT: tl.constexpr, ADD_TO_OUT: tl.constexpr,
               PREFETCH: tl.constexpr, TMA: tl.constexpr, TMA_X: tl.constexpr, N_TILES: tl.constexpr,
               ZERO_PAD: tl.constexpr, EXPAND: tl.constexpr):
    """_grouped_gemm_kernel's work on BLOCK_M rows from row0 (a routing block, or its first half) and N_TILES N
    tiles from first_n: the K-loops and epilogues."""
    SPLIT: tl.constexpr = GATED and TMA
    WN: tl.constexpr = 2 * BLOCK_N if GATED and not TMA else BLOCK_N
    LOOP: tl.constexpr = EXPAND == 2  # the expand as the K-loop's first step (launch_expand says where it can)
    EARLY_S: tl.constexpr = PREFETCH and LORA == 2 and NUM_SLICES == 1 and not LOOP
    FIRST: tl.constexpr = EARLY_S and EXPAND == 1  # the expand before the K-loop
    # LORA 1 over several tiles holds S in registers through the later K-loops: the bias waits for the epilogue
    # (compiled for sm90, gpt-oss's down GEMM spilled with both held)
    EARLY_BIAS: tl.constexpr = HAS_BIAS and PREFETCH and not (LORA == 1 and N_TILES > 1)
    a_safe = tl.maximum(a, 0).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    row_ok = pair < num_pairs
    if X_SORTED:
        xrow = offs_m
    else:
        xrow = tl.minimum(pair, num_pairs - 1) // TOPK  # padding rows: a valid address, never stored
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < 0
    if LORA > 0:
        rank = tl.load(Ranks + a_safe)
        r_ok = (offs_r < rank) & (offs_r < R) & (a >= 0)  # columns past the loaded rank: ignored even if not 0
    if MUL_TOPK and PREFETCH:
        tw = tl.load(TopkW + tl.minimum(pair, num_pairs - 1))
    if EARLY_S:  # one S tile per row block, whichever N tiles the program walks
        st = _s_tile(S, LB, offs_m, offs_r, r_ok, 0, R, stride_sm, stride_sr, UPCAST)
    else:  # LORA 1: the first tile's shrink replaces it before any expand reads it
        st = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        if not UPCAST:
            st = st.to(LB.dtype.element_ty)

    for t in tl.static_range(N_TILES):
        pid_n = first_n + t
        if pid_n < num_n:  # always for t == 0; the row block's last group may be short
            j, col, wrow = _tile_cols(pid_n, N, GATED and not TMA, BLOCK_N, WN)
            lb_ptrs = (LB + a_safe * stride_lbl + e * stride_lbe + offs_r[:, None] * stride_lbr
                       + wrow[None, :] * stride_lbn)
            # this tile's LoRA B tile (and bias), issued before its K-loop so their latency hides behind it
            if LORA == 1:
                if FAULT == 4:  # lora_b_unmasked: rows past N unwrapped (next expert's B; the allocation's end holds)
                    lb_off = (a_safe * stride_lbl + e * stride_lbe + offs_r[:, None] * stride_lbr
                              + (col + (j % 2) * N if GATED else col)[None, :] * stride_lbn)
                    bt = tl.load(LB + lb_off, mask=r_ok[:, None] & (lb_off < lb_numel), other=0.0)
                else:
                    bt = tl.load(lb_ptrs, mask=r_ok[:, None], other=0.0)
            if EARLY_S:
                bt, bu = _b_tiles(LB, lb_ptrs, r_ok, col, SliceOffs, 0, N, stride_lbn, SPLIT, UPCAST)
            if EARLY_BIAS:
                bias, bias_up = _bias_rows(Bias, e, wrow, N, stride_be, stride_bn, SPLIT)
            if ADD_TO_OUT:  # the accumulator starts from the base output already in Out, and the K-loop is empty
                o_off, o_mask = _out_tile(offs_m, pair, row_ok, pid_n, N, stride_om, stride_on, OUT_SORTED, BLOCK_N)
                acc = tl.load(Out + o_off, mask=o_mask, other=0.0).to(tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, WN), dtype=tl.float32)  # SPLIT: the gate columns
            acc_up = acc
            if SPLIT:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if FIRST:
                if a >= 0:
                    acc = tl.dot(st, bt, acc, input_precision=DOT_PREC)
                    if SPLIT:
                        acc_up = tl.dot(st, bu, acc_up, input_precision=DOT_PREC)
            acc_s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            if LOOP:
                acc = _k_loop_expand(X, W, S, LB, acc, xrow, offs_m, row_ok, wrow, e, a, a_safe, Kdim, R,
                                     stride_xm, stride_xk, stride_wn, stride_we, stride_wk, stride_sm, stride_sr,
                                     stride_lbl, stride_lbe, stride_lbn, stride_lbr, K_TILES, EVEN_K, UPCAST,
                                     DOT_PREC, ZERO_PAD, BLOCK_K)
            else:
                acc, acc_up, acc_s = _k_loop(
                    X, W, LA, acc, acc_up, acc_s, xrow, row_ok, wrow, e, e32, a_safe, row0, pid_n, N, Kdim, r_ok,
                    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_lal, stride_lae, stride_lar,
                    stride_lak, LORA == 1 and t == 0, SPLIT, TMA, TMA_X, K_TILES, EVEN_K, UPCAST, DOT_PREC,
                    ZERO_PAD, BLOCK_N, BLOCK_K, BLOCK_R)

            acc_l = tl.zeros((BLOCK_M, WN), dtype=tl.float32)  # the LoRA delta kept apart (faults 1-3 only)
            if LORA == 1 and t == 0:
                st = acc_s * tl.load(Scaling + a_safe)
                st = st.to(tl.float32) if UPCAST else st.to(LB.dtype.element_ty)
            if LORA > 0 and not FIRST and not LOOP:
                if a >= 0:
                    if LORA == 1:
                        bl = bt.to(tl.float32) if UPCAST else bt
                        if FAULT == 1 or FAULT == 2 or FAULT == 3:
                            acc_l = tl.dot(st, bl, acc_l, input_precision=DOT_PREC)
                        else:
                            acc = tl.dot(st, bl, acc, input_precision=DOT_PREC)
                    else:
                        for s in tl.static_range(NUM_SLICES):  # S holds the slices' shrinks side by side
                            if not EARLY_S:
                                st = _s_tile(S, LB, offs_m, offs_r, r_ok, s, R, stride_sm, stride_sr, UPCAST)
                                bt, bu = _b_tiles(LB, lb_ptrs, r_ok, col, SliceOffs, s, N, stride_lbn, SPLIT,
                                                  UPCAST)
                            acc = tl.dot(st, bt, acc, input_precision=DOT_PREC)
                            if SPLIT:
                                acc_up = tl.dot(st, bu, acc_up, input_precision=DOT_PREC)

            if HAS_BIAS:
                if not EARLY_BIAS:
                    bias, bias_up = _bias_rows(Bias, e, wrow, N, stride_be, stride_bn, SPLIT)
                acc += bias[None, :]
                if SPLIT:
                    acc_up += bias_up[None, :]
            if SPLIT:
                h = _act(acc, acc_up, ACT)
            elif GATED:
                h = _gated_act(acc, ACT, BLOCK_M, BLOCK_N)
                if FAULT == 1:  # lora_after_activation
                    h += _gated_act(acc_l, ACT, BLOCK_M, BLOCK_N)
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
            o_off, o_mask = _out_tile(offs_m, pair, row_ok, pid_n, N, stride_om, stride_on, OUT_SORTED, BLOCK_N)
            if FAULT == 4:  # lora_b_unmasked: LoRA blocks store their overflow columns into the next row
                o_mask = o_mask | (row_ok[:, None] & (a >= 0) & (o_off < out_numel))
            tl.store(Out + o_off, h.to(Out.dtype.element_ty), mask=o_mask)


# ----------------------------------------------------------------------------------------------------------------
# launchers

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
# (benchmarks/results/e2e_notes.md, session 8): base calls 69.6k tok/s computed, 72.0k zero, 74.1k half; LoRA calls
# with the shrink in the K-loop 61.8k / 64.1k / 63.2k, with the shrink once 63.0k zero / 64.5k half.
PADDING = ("compute", "zero", "half")


# Where the expert GEMMs' LoRA expand S B^T runs when the shrink comes precomputed (LORA 2), the kernel's EXPAND
# constexpr by index. "last": a dot in the epilogue after the K-loop; "first" (needs prefetch): the accumulator's
# first product, before the K-loop, its S and B tiles loaded outside the pipeline; "loop": the K-loop's first step,
# its tiles loaded by the same pipeline as X and W (pointer loads only: a TMA launch runs "first"). H200, full-depth
# bf16 forward (benchmarks/results/e2e_notes.md): first vs last a tie on Qwen3, +1.7 % on gpt-oss (run 46); loop vs
# first +2.4 % on Qwen3's LoRA call (67.0k vs 65.5k tok/s), +0.9 % on gpt-oss (run 52).
EXPAND = ("last", "first", "loop")
# moe_configs' GemmConfig.expand. A module constant rather than an engine option: benchmarks/bench_e2e.py
# (--moe-expand) sets it per engine to time the placements in one run.
MOE_EXPAND = "loop"


def auto_padding(lora: "MoeLoraWeights | None", once: bool) -> str:
    return "zero" if lora is not None and not once else "half"


def half_tail(cfg: GemmConfig) -> bool:
    """Whether the kernel runs half-used last blocks as half-height tiles (cfg.block_m is the routing block)."""
    return cfg.padding == "half" and cfg.block_m >= 32


SMEM_BUDGET = 216 * 1024  # bytes of pipelined tiles per program (Triton reuses them for the epilogue); Hopper: 227 KiB
SMEM_LIMIT = 227 * 1024  # what one block may use on Hopper (sm90)


def default_config(num_pairs: int, num_groups: int, n: int, kdim: int, device: torch.device,
                   dtype: torch.dtype = torch.bfloat16, gated: bool = False, rank: int = 0,
                   held_rank: int = 0) -> GemmConfig:
    """Small heuristic instead of autotuning (the interpreter cannot autotune, and tuning per call would cost the
    runtime a compile storm). block_m follows the expected rows per group, so padding stays small; the dot is 256
    wide for big row blocks (128 x 256 x 64 bf16 tiles were the fastest of those tried on an H100, see
    benchmarks/results/kernels_notes.md); fp32 runs on FMA units and gets smaller tiles; the pipeline depth is
    what fits in shared memory. block_n counts output columns: a gated dot is twice as wide.
    rank: an A tile of that rank per pipeline stage (LORA 1). held_rank: a B tile (held_rank, dot width) that stays
    in shared memory through the K-loop (LORA 2 with the epilogue prefetched; compiled for sm90 it takes
    next_pow2(held_rank) x 256 bf16 beside the stages: 16 KB at rank 32, 64 KB at rank 128). LORA 1 holds its B
    tile too (always loaded before the K-loop); it is kept within SMEM_LIMIT rather than the stage budget, which
    leaves rank 32's 4 stages as they were measured (229376 B compiled for sm90) and gives rank 128 2 stages
    instead of 3 (262144 B, more than a block may have)."""
    if device.type != "cuda":  # interpreter: small tiles keep the program count and the per-step cost low
        return GemmConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=1)
    rows = num_pairs / max(1, num_groups)
    block_m = 16 if rows <= 24 else 32 if rows <= 48 else 64 if rows <= 160 else 128
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
    return GemmConfig(block_m, wn // 2 if gated else wn, block_k, group_m=4,
                      num_warps=8 if block_m * wn >= 128 * 128 else 4, num_stages=stages)


@dataclass(slots=True)
class ShrinkConfig:
    """Launch of _lora_shrink_kernel. rows: rows per program, a divisor of the routing block (programs then
    cover sub-blocks of it: more programs, fewer rows each); 0 = the routing block. block_k: 0 = shrink_block_k's
    choice. Defaults: the best of the sweep on an H200 (bench_kernels --sweep-shrink, run 24, commit e35340a, bf16,
    T=4096, rank 32; sum over Qwen3 and gpt-oss, gate_up and down: 0.177 ms with 8 warps vs 0.217 with the 4 used
    before, most of it Qwen3's down shrink, 0.056 -> 0.032 ms). In the full forward (run 26) the 96 shrink
    launches took 3.711 ms with 8 warps vs 3.712 ms with 4 (run 24): the sweep's gain did not carry over, so
    treat 4 vs 8 as a tie (the sweep times the default first, cold)."""
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


_CONST_CACHE: dict = {}


MAX_RANK = 128  # the shrink keeps a (BLOCK_M, next_pow2(R)) fp32 accumulator in registers


def check_kernel_rank(rank: int) -> None:
    if rank > MAX_RANK:
        raise ValueError(f"max rank {rank} > {MAX_RANK} is not supported by the Triton LoRA kernels; use impl='torch'")


def _cached(key: tuple, make) -> torch.Tensor:
    """A small device tensor made once per key and reused by every launch after."""
    if key not in _CONST_CACHE:
        _CONST_CACHE[key] = make()
    return _CONST_CACHE[key]


def device_const(values: tuple, device: torch.device) -> torch.Tensor:
    """A small int32 tensor built once per (values, device): building it per call would be a host-to-device copy."""
    return _cached(("const", values, str(device)), lambda: torch.tensor(values, dtype=torch.int32, device=device))


def placeholder(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A never-read stand-in for an absent tensor argument, allocated once per (shape, dtype, device): an
    allocation per launch costs microseconds of host time, and the runtime's LoRA path is host-bound."""
    return _cached(("placeholder", shape, dtype, str(device)), lambda: torch.empty(shape, dtype=dtype, device=device))


def launch_shrink(x, a, scaling, ranks, routing: MoeRouting, x_sorted: bool,
                  cfg: ShrinkConfig | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """a viewed as (L, E, S, R, Kdim) (expand()ed dims may have stride 0) -> S (M, S*R) in dtype, default float32
    (computed in fp32, rounded once on store)."""
    L, E, NS, R, Kdim = a.shape
    M = routing.sorted_ids.shape[0]
    s = torch.empty(M, NS * R, dtype=dtype or torch.float32, device=x.device)
    cfg = cfg or ShrinkConfig()
    rows, block_k = cfg.resolve(routing.block_m, next_pow2(R), x.dtype, x.is_cuda)
    grid = (routing.num_blocks * (routing.block_m // rows), NS)
    _lora_shrink_kernel[grid, x.device](
        x, a, s, scaling, ranks, routing.sorted_ids, routing.block_expert, routing.block_adapter,
        routing.num_padded, routing.num_pairs, Kdim,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), a.stride(3), a.stride(4),
        s.stride(0), s.stride(1),
        TOPK=routing.top_k, X_SORTED=x_sorted, R=R, ROUTE_M=routing.block_m, BLOCK_M=rows, BLOCK_R=next_pow2(R),
        BLOCK_K=block_k, K_TILES=triton.cdiv(Kdim, block_k), EVEN_K=Kdim % block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dot_flags(x.dtype, x.device))
    return s


def tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte aligned strides, the last one 1."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]))


def gemm_tma(cfg: GemmConfig, x, w, mode: int, add_to_out: bool, x_sorted: bool) -> tuple[bool, bool]:
    """(W by TMA, X by TMA) for a launch asking cfg.tma. W: without the K-loop shrink (LORA 1, the bug zoo's
    branch) and add_to_out, and when its strides allow a descriptor, else the pointer loads; X: sorted rows only
    (gathered rows are not a block of the tensor), and only beside W, and not with padding "half" (a descriptor's
    blocks are block_m rows; half blocks load block_m / 2). fp32 on the GPU keeps the pointer loads:
    compiled for sm90, its TMA variant came out at 32 registers with ~16 KB of spills per thread (ptxas -v)."""
    tma_w = (cfg.tma and mode != 1 and not add_to_out and tma_ok(w)
             and (w.element_size() == 2 or w.device.type != "cuda"))
    return tma_w, tma_w and x_sorted and tma_ok(x) and not half_tail(cfg)


def launch_expand(cfg: GemmConfig, mode: int, num_slices: int, tma_w: bool, add_to_out: bool) -> int:
    """The kernel's EXPAND for a launch: cfg.expand's index, except that "loop" needs the one-slice precomputed
    shrink (LORA 2) with W by pointer loads and a K-loop (not add_to_out); elsewhere it runs "first"."""
    if cfg.expand == "loop" and not (mode == 2 and num_slices == 1 and not tma_w and not add_to_out):
        return EXPAND.index("first")
    return EXPAND.index(cfg.expand)


def launch_gemm(x, w, out, routing: MoeRouting, cfg: GemmConfig, *, x_sorted: bool, out_sorted: bool,
                activation: str = "none", bias=None, lora_a=None, lora_s=None, lora_b=None, scaling=None,
                ranks=None, slice_offsets: tuple | None = None, topk_weights=None, fault: int = 0,
                add_to_out: bool = False) -> torch.Tensor:
    """w (E, N_w, Kdim) with N_w = 2N when gated; bias (E, N_w); lora_b viewed as (L, E, N_w, R).
    LoRA either as lora_a (L, E, R, Kdim) (shrink fused into the K-loop) or as a precomputed, scaled lora_s
    (M, S*R) with slice_offsets (dense layers). add_to_out: out already holds x w^T (+ bias); only the
    precomputed LoRA delta is added to it, in place (x and w are not read)."""
    gated = GATED.get(activation, False)
    E, n_w, kdim = w.shape
    n = n_w // 2 if gated else n_w
    mode = 1 if lora_a is not None else 2 if lora_s is not None else 0
    assert not add_to_out or (mode == 2 and not gated and bias is None and topk_weights is None), \
        "add_to_out adds a precomputed lora_s delta only: no activation, bias or top-k weight"
    offs = slice_offsets if slice_offsets is not None else (0, n)
    assert cfg.n_tiles == 1 or (not add_to_out and len(offs) == 2), \
        "n_tiles > 1 is for the expert GEMMs: the dense path (add_to_out, several slices) walks one N tile"
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
        xa, wa, bias if bias is not None else dummy, out, la, sv, lb,
        scaling if mode else dummy, ranks if mode else dummy, topk_weights if topk_weights is not None else dummy,
        routing.sorted_ids, routing.block_expert, routing.block_adapter, routing.num_padded,
        device_const(tuple(offs), x.device), routing.num_pairs, n, kdim, lb.numel(), out.numel(),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1), la.stride(0), la.stride(1), la.stride(2), la.stride(3),
        sv.stride(0), sv.stride(1), lb.stride(0), lb.stride(1), lb.stride(2), lb.stride(3),
        TOPK=routing.top_k, X_SORTED=x_sorted, OUT_SORTED=out_sorted, GATED=gated, ACT=ACTIVATIONS[activation],
        HAS_BIAS=bias is not None, LORA=mode, MUL_TOPK=topk_weights is not None,
        NUM_SLICES=len(offs) - 1, R=R, BLOCK_M=routing.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=next_pow2(R), GROUP_M=cfg.group_m,
        K_TILES=0 if add_to_out else triton.cdiv(kdim, cfg.block_k), EVEN_K=kdim % cfg.block_k == 0,
        FAULT=fault, ADD_TO_OUT=add_to_out, PREFETCH=cfg.prefetch, TMA=tma_w, TMA_X=tma_x, N_TILES=cfg.n_tiles,
        ZERO_PAD=cfg.padding != "compute", HALF_TAIL=half_tail(cfg), EXPAND=expand,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dot_flags(x.dtype, x.device))
    return out


LORA_SHRINK = ("auto", "once", "fused")
# "auto" = "once". The shrink in the K-loop ("fused", programs walking several N tiles) was auto's choice for Qwen3's
# shape from session 7 (kernel stage times, run 30) until full-depth timed loops on an H200 ranked once (padding half)
# above it four runs in a row: LoRA call 64.5k vs 64.1k tok/s (run 40), 66.4k vs 65.1k (run 41), 66.5k vs 64.8k
# (run 45), 65.3k vs 63.9k (run 46; benchmarks/results/e2e_notes.md); gpt-oss was faster once already (23 and 12 N
# tiles). The fused GEMMs run padding "zero" where once runs "half" (auto_padding), which the stage times missed.


def kernel_fault() -> str | None:
    """The active bug-zoo fault when it lives inside the grouped GEMM's fused shrink path (KERNEL_FAULTS)."""
    fault = faults.active()
    return fault if fault in KERNEL_FAULTS["gate_up"] or fault in KERNEL_FAULTS["down"] else None


def check_lora_shrink(lora_shrink: str) -> None:
    if lora_shrink not in LORA_SHRINK:
        raise ValueError(f"lora_shrink must be one of {LORA_SHRINK}, got {lora_shrink!r}")


def resolve_lora_shrink(lora_shrink: str) -> str:
    """"auto" -> the mode it stands for ("once"); other modes come back as given."""
    check_lora_shrink(lora_shrink)
    return "once" if lora_shrink == "auto" else lora_shrink


def shrink_once(lora: MoeLoraWeights | None, lora_shrink: str) -> bool:
    """Whether the expert GEMMs get their shrink precomputed (LORA 2); a bug-zoo kernel fault forces the fused
    shrink (LORA 1), the branch where those faults live."""
    return lora is not None and resolve_lora_shrink(lora_shrink) == "once" and kernel_fault() is None


def moe_configs(x, topk_ids, w_gate_up, activation: str, lora: MoeLoraWeights | None,
                once: bool, device: torch.device | None = None, **flags) -> tuple[GemmConfig, GemmConfig]:
    """Default tiles of the gate_up and down GEMMs. The LoRA A tile takes pipeline stages only when the shrink
    runs in the K-loop; precomputed (once), the GEMMs get the stage count of the no-LoRA path unless a B tile
    prefetched outside the pipeline (expand "first" / "last") leaves room for fewer (rank 64 and up at 128 x 256 x
    64 bf16 tiles: 3 stages instead of 4).
    padding: auto_padding's unless flags say. flags: GemmConfig fields to change in both (prefetch=False for the
    A/B of the epilogue loads). device: the device to pick tiles for, if not x's (bench_kernels --compile-sm90
    builds GPU launches on meta tensors)."""
    device = device or x.device
    T, H = x.shape
    n1 = w_gate_up.shape[1]
    gated = GATED[activation]
    inter_n = n1 // 2 if gated else n1
    pairs = T * topk_ids.shape[1]
    # rows spread over (expert, slot) groups; used slots are not known without a sync
    groups = w_gate_up.shape[0] * max(1, lora.num_slots if lora is not None else 0)
    stage_rank = lora.max_rank if lora is not None and not once else 0
    flags = dict(padding=auto_padding(lora, once), expand=MOE_EXPAND) | flags
    # the expand "loop" brings B through the pipeline's own buffers (a TMA launch runs "first" instead)
    in_loop = flags["expand"] == "loop" and not flags.get("tma", False)
    held_rank = lora.max_rank if lora is not None and once and flags.get("prefetch", True) and not in_loop else 0
    return (replace(default_config(pairs, groups, inter_n, H, device, x.dtype, gated, stage_rank, held_rank),
                    **flags),
            replace(default_config(pairs, groups, H, inter_n, device, x.dtype, False, stage_rank, held_rank),
                    **flags))


def expert_shrink(inp: torch.Tensor, lora: MoeLoraWeights, gemm: str, routing: MoeRouting,
                  cfg: ShrinkConfig | None = None) -> torch.Tensor:
    """The scaled shrink of one expert GEMM ("gate_up": x gathered by pair // top_k; "down": the sorted
    intermediate) over every routed row, once per row block: (M, R) in inp's dtype, the rounding every expand
    placement applies before its dot (expand "loop" loads it through X's pointers)."""
    a = getattr(lora, f"{gemm}_a")
    return launch_shrink(inp, a.unsqueeze(2), lora.scaling, lora.ranks, routing, x_sorted=gemm == "down", cfg=cfg,
                         dtype=inp.dtype)


def expert_lora_kwargs(lora: MoeLoraWeights | None, gemm: str, s: torch.Tensor | None) -> dict:
    """launch_gemm's LoRA arguments of one expert GEMM: the precomputed shrink s (LORA 2: only the expand in the
    epilogue) or, s None, A for the shrink fused into the K-loop (LORA 1, where the bug zoo's kernel faults live)."""
    if lora is None:
        return {}
    kw = dict(lora_b=getattr(lora, f"{gemm}_b"), scaling=lora.scaling, ranks=lora.ranks)
    if s is not None:
        return dict(kw, lora_s=s)
    return dict(kw, lora_a=getattr(lora, f"{gemm}_a"), fault=KERNEL_FAULTS[gemm].get(faults.active(), 0))


def moe_forward_triton(x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up=None, b_down=None,
                       lora: MoeLoraWeights | None = None, token_adapter=None,
                       config: GemmConfig | None = None, down_config: GemmConfig | None = None,
                       lora_shrink: str = "auto", sum_topk: bool = True,
                       shrink_config: ShrinkConfig | None = None,
                       n_tiles: int | tuple[int, int] | None = None, padding: str | None = None) -> torch.Tensor:
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
    check_kernel_rank(lora.max_rank if lora is not None else 0)
    T, H = x.shape
    E, n1, _ = w_gate_up.shape
    K = topk_ids.shape[1]
    inter_n = n1 // 2 if GATED[activation] else n1
    once = shrink_once(lora, lora_shrink)
    cfg1, cfg2 = moe_configs(x, topk_ids, w_gate_up, activation, lora, once)
    cfg1, cfg2 = config or cfg1, down_config or cfg2
    if n_tiles is not None:
        t1, t2 = (n_tiles, n_tiles) if isinstance(n_tiles, int) else n_tiles
        cfg1, cfg2 = replace(cfg1, n_tiles=t1), replace(cfg2, n_tiles=t2)
    if padding is not None:
        cfg1, cfg2 = replace(cfg1, padding=padding), replace(cfg2, padding=padding)
    assert cfg2.block_m == cfg1.block_m, "both GEMMs share one alignment, so block_m must match"
    routing = moe_align(topk_ids, token_adapter if lora is not None else None, E,
                        lora.num_slots if lora is not None else 0, cfg1.block_m, impl="triton")
    inter = torch.empty(routing.sorted_ids.shape[0], inter_n, dtype=x.dtype, device=x.device)
    s1 = expert_shrink(x, lora, "gate_up", routing, shrink_config) if once else None
    launch_gemm(x, w_gate_up, inter, routing, cfg1, x_sorted=False, out_sorted=True, activation=activation,
                bias=b_gate_up, **expert_lora_kwargs(lora, "gate_up", s1))
    del s1  # its memory can serve s2
    s2 = expert_shrink(inter, lora, "down", routing, shrink_config) if once else None
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    launch_gemm(inter, w_down, y, routing, cfg2, x_sorted=True, out_sorted=False, bias=b_down,
                topk_weights=topk_weights.reshape(-1).float(), **expert_lora_kwargs(lora, "down", s2))
    if not sum_topk:
        return y.view(T, K, H)
    return y.view(T, K, H).sum(dim=1) if K > 1 else y


# ----------------------------------------------------------------------------------------------------------------
# public op

def check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up, b_down, lora,
                     token_adapter) -> None:
    """One clear error per bad input, naming the fix; shapes only, so no host synchronisation."""
    if activation not in GATED:
        raise ValueError(f"activation {activation!r} unknown; use one of {sorted(GATED)}")
    if x.ndim != 2:
        raise ValueError(f"x must be (T, H), got {tuple(x.shape)}")
    T, H = x.shape
    if w_gate_up.ndim != 3 or w_gate_up.shape[2] != H:
        raise ValueError(f"w_gate_up must be (E, N1, H={H}) in nn.Linear orientation, got {tuple(w_gate_up.shape)}")
    E, n1, _ = w_gate_up.shape
    inter = n1 // 2 if GATED[activation] else n1
    if GATED[activation] and n1 % 2:
        raise ValueError(f"gated activation {activation!r} needs gate then up rows (N1 = 2I), got N1 = {n1}")
    if w_down.shape != (E, H, inter):
        raise ValueError(f"w_down must be (E, H, I) = {(E, H, inter)}, got {tuple(w_down.shape)}"
                         + (" (relu2 is not gated: w_gate_up holds I rows)" if activation == "relu2" else ""))
    if topk_ids.ndim != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be (T={T}, K), got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise ValueError("topk_ids must be an integer tensor of expert indices")
    if b_gate_up is not None and b_gate_up.shape != (E, n1):
        raise ValueError(f"b_gate_up must be (E, N1) = {(E, n1)}, got {tuple(b_gate_up.shape)}")
    if b_down is not None and b_down.shape != (E, H):
        raise ValueError(f"b_down must be (E, H) = {(E, H)}, got {tuple(b_down.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} is {t.dtype} but x is {x.dtype}; cast the weights to the run dtype")
    if lora is None:
        return
    if token_adapter is None or token_adapter.shape != (T,):
        raise ValueError(f"lora given, so token_adapter must be a (T={T},) int tensor of slots (-1 = none); got "
                         f"{None if token_adapter is None else tuple(token_adapter.shape)}")
    _, Ea, _, Ha = lora.gate_up_a.shape
    if (Ea, Ha) != (E, H) or lora.gate_up_b.shape[2] != n1 or lora.down_a.shape[3] != inter:
        raise ValueError(f"LoRA shapes {tuple(lora.gate_up_a.shape)}/{tuple(lora.gate_up_b.shape)}/"
                         f"{tuple(lora.down_a.shape)} do not fit experts E={E}, H={H}, N1={n1}, I={inter}")


def _misread_as_gated(w_down, lora):
    """Fault relu2_as_gated: a runner that knows only gated experts splits the I up rows into gate|up halves,
    applies SiLU-and-mul, and runs the down GEMM (and its LoRA-A) over the first I/2 input columns."""
    half = w_down.shape[2] // 2
    if lora is not None:
        lora = MoeLoraWeights(lora.gate_up_a, lora.gate_up_b, lora.down_a[..., :half], lora.down_b, lora.scaling,
                              lora.ranks)
    return "silu", w_down[..., :half], lora


def moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, activation: str, b_gate_up=None, b_down=None,
                lora: MoeLoraWeights | None = None, token_adapter=None, impl: str = "auto",
                backend: str = "triton", lora_shrink: str = "auto", sum_topk: bool = True,
                n_tiles: int | tuple[int, int] | None = None, padding: str | None = None) -> torch.Tensor:
    """(T, H) MoE output: sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(x[t]) with per-token LoRA slots.

    activation: "silu" (gated SiLU), "swiglu_oai" (gpt-oss clamped SwiGLU, alpha 1.702, limit 7.0),
    "relu2" (non-gated relu(x)^2). Same dtype as x; fp32 accumulation inside.
    backend (impl triton only): "triton" (this file's fused kernel) or "grouped_mm" (kernels/moe_grouped.py).
    lora_shrink, n_tiles, padding (backend triton only): see moe_forward_triton.
    sum_topk False (impl and backend triton only; the other paths return (T, H) summed): (T, K, H) per-pair
    outputs, already top-k weighted, for the caller to sum."""
    from lpdiff.kernels.moe_grouped import BACKENDS, moe_forward_grouped  # lazy: moe_grouped builds on this file

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_lora_shrink(lora_shrink)
    if activation == "relu2" and faults.on("relu2_as_gated"):
        activation, w_down, lora = _misread_as_gated(w_down, lora)
    check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up, b_down, lora,
                     token_adapter)
    args = (x, topk_ids, topk_weights, w_gate_up, w_down, activation, b_gate_up, b_down, lora, token_adapter)
    if resolve_impl(impl, x) == "torch":
        return moe_forward_torch(*args)
    if backend == "grouped_mm":
        return moe_forward_grouped(*args)
    return moe_forward_triton(*args, lora_shrink=lora_shrink, sum_topk=sum_topk, n_tiles=n_tiles, padding=padding)
