"""MoE expert GEMMs with multi-adapter LoRA on torch's grouped GEMM: the base GEMMs by ``torch._grouped_mm``
(CUTLASS on sm90/sm100 for bf16, what transformers' experts_implementation="grouped_mm" runs), the LoRA deltas
added in place by the fused kernel's shrink and epilogue passes (lora_shrink.py, lora_gemm.py), bias + activation and
the weighted top-k sum as small Triton kernels. Same semantics as ``moe.moe_forward``; picked there with
``backend="grouped_mm"`` (the default stays the fused Triton kernel until a GPU A/B says otherwise).

Shapes: T tokens, K top-k, E experts, H hidden, I expert width, N1 = 2I (gated: gate rows then up rows) or I,
P = T*K rows, one per (token, expert) pair, sorted by expert with no padding (the grouped GEMM wants each expert's
rows contiguous, ended by offs), L adapter slots, R max rank, M2 padded rows of the LoRA blocks.

Per layer:
  1. moe_align at block 1: the pairs sorted by expert (row -> pair, row -> expert); offs by a searchsorted over the
     sorted experts (no host synchronisation anywhere).
  2. x rows gathered (P, H); grouped GEMM gate_up -> (P, N1) in x's dtype.
  3. LoRA: the sorted rows aligned again, by (expert, slot) into blocks (moe_align with top-k 1, so a block's
     "pair" is a sorted row); launch_shrink, then launch_gemm(add_to_out=True) adds the delta to the rows that
     have an adapter, in place. Rows without one are not touched.
  4. bias + activation (one Triton pass, fp32 math) -> (P, I) in x's dtype.
  5. grouped GEMM down -> (P, H); its LoRA delta as in 3 (same blocks).
  6. out[t] = sum_k w[t,k] (y[row(t,k)] + b_down[e]) in fp32, k in order (deterministic, no atomics).
The weights stay in nn.Linear orientation (E, N, K): their transposed view is K-major, the layout CUTLASS reads
natively, so no copy is made (bench_kernels.py times gate_up on a contiguous (E, K, N) copy beside it).
Compared with the fused kernel this reads and writes the (P, N1) and (P, H) intermediates a few more times (the
gather, the in-place deltas, the activation, the sum), and in exchange runs the two big GEMMs on CUTLASS.

Where it runs: ``grouped_mm_unsupported`` is the one place that decides. CUDA needs bf16 on an sm90/sm100 GPU
(elsewhere torch's grouped_mm is a loop of mm after a host sync of offs, and fp32 must stay IEEE for parity with
HF: those runs, and any fault of the bug zoo that lives inside the fused kernel, go to moe_forward_triton). On CPU
torch's grouped_mm is a loop of mm in any dtype (IEEE for fp32 here), and the Triton kernels run interpreted: that
is how tests check this file without a GPU; the CUTLASS kernel itself is only checked on a GPU.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from lpdiff.kernels._triton import device_const, dual_jit, tl, triton
from lpdiff.kernels.activation import ACTIVATIONS, GATED, _gated_act, activate
from lpdiff.kernels.fused_moe_lora import kernel_fault, moe_forward_triton
from lpdiff.kernels.gemm_config import GemmConfig
from lpdiff.kernels.lora_gemm import launch_gemm
from lpdiff.kernels.lora_linear import delta_config, ieee_fp32_matmul
from lpdiff.kernels.lora_shrink import check_kernel_rank, launch_shrink
from lpdiff.kernels.lora_weights import MoeLoraWeights
from lpdiff.kernels.moe_align import MoeRouting, moe_align
from lpdiff.kernels.moe_inputs import MoeInputs

BACKENDS = ("triton", "grouped_mm")
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_warned: set = set()


def _operand_ok(t: torch.Tensor) -> bool:
    """grouped_mm's stride rule for a 2D (rows, K) operand or a (E, N, K) weight read transposed: K contiguous,
    the other stride a multiple of 16 bytes, the data 16-byte aligned."""
    align = 16 // t.element_size()
    return t.stride(-1) == 1 and t.stride(-2) % align == 0 and t.data_ptr() % 16 == 0


def grouped_mm_unsupported(moe: MoeInputs) -> str | None:
    """Why the grouped_mm backend cannot run these inputs (they then run on moe_forward_triton), or None."""
    x, w_gate_up, w_down = moe.x, moe.w_gate_up, moe.w_down
    if _GROUPED_MM is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            return f"{x.dtype} on CUDA (torch's CUTLASS grouped GEMM is bf16 only; fp32 stays IEEE on Triton)"
        if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
            return "not an sm90/sm100 GPU (torch's grouped_mm would loop over experts after a host sync)"
    if (fault := kernel_fault()) is not None:
        return f"bug-zoo fault {fault!r} lives in the fused kernel"
    H, I = x.shape[1], w_down.shape[2]
    if not all(_operand_ok(t) for t in (w_gate_up, w_down)) or any(n % (16 // x.element_size()) for n in (H, I)):
        return f"H={H} / I={I} or the weights' strides are not 16-byte aligned (grouped_mm's rule)"
    return None


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(P, Kdim) rows sorted by expert x w (E, N, Kdim) in nn.Linear orientation -> (P, N). The transposed view
    is Kdim-major, the layout the CUTLASS kernel reads natively, so no copy of the weights is made."""
    if _GROUPED_MM is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm (grouped_mm_unsupported says so first)")
    with ieee_fp32_matmul():
        return _GROUPED_MM(a, w.transpose(1, 2), offs=offs)


# ----------------------------------------------------------------------------------------------------------------
# routing: rows sorted by expert, and the LoRA blocks over them


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> row_pair (P,) int32 (pair t*K+k of each sorted row), row_expert (P,) int32 (non-decreasing),
    offs (E,) int32 cumulative row ends per expert (an expert with no rows repeats the previous end)."""
    r = moe_align(topk_ids, None, num_experts, 0, 1, impl="triton")
    experts = device_const(tuple(range(num_experts)), topk_ids.device)
    offs = torch.searchsorted(r.block_expert, experts, right=True, out_int32=True)
    return r.sorted_ids, r.block_expert, offs


def lora_blocks(
    row_expert: torch.Tensor, row_slot: torch.Tensor, num_experts: int, num_slots: int, block_m: int
) -> MoeRouting:
    """The sorted rows grouped by (expert, slot) and padded to block_m: a routing with top-k 1 whose "pairs" are
    the sorted rows, so the LoRA passes read and write rows of the grouped GEMMs' outputs in place."""
    return moe_align(row_expert.view(-1, 1), row_slot, num_experts, num_slots, block_m, impl="triton")


def plan_lora(
    row_expert: torch.Tensor, row_slot: torch.Tensor, lora: MoeLoraWeights, num_experts: int, widths: tuple[int, int]
) -> tuple[MoeRouting, GemmConfig, GemmConfig]:
    """The LoRA blocks and the two delta passes' tiles (gate_up's N1 and down's H wide). One (expert, slot)
    blocking serves both: block_m follows the expected rows of a group, which the two share."""
    rows = max(1, row_expert.shape[0] // (num_experts * lora.num_slots))
    cfg1, cfg2 = (delta_config(rows, n, row_expert.device, lora.gate_up_a.dtype) for n in widths)
    return lora_blocks(row_expert, row_slot, num_experts, lora.num_slots, cfg1.block_m), cfg1, cfg2


def add_lora_delta(
    out: torch.Tensor,
    inp: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    lora: MoeLoraWeights,
    blocks: MoeRouting,
    w: torch.Tensor,
    cfg: GemmConfig,
) -> None:
    """out[rows] += scaling (inp[rows] A[slot, e]^T) B[slot, e]^T for rows with an adapter; a (L, E, R, in),
    b (L, E, out, R), w the expert weights of this GEMM (its shape only: the pass has no K-loop)."""
    s = launch_shrink(inp, a.unsqueeze(2), lora.scaling, lora.ranks, blocks, x_sorted=False)
    launch_gemm(
        inp,
        w,
        out,
        blocks,
        cfg,
        x_sorted=False,
        out_sorted=False,
        lora_s=s,
        lora_b=b,
        scaling=lora.scaling,
        ranks=lora.ranks,
        add_to_out=True,
    )


# ----------------------------------------------------------------------------------------------------------------
# bias + activation


@dual_jit
def _bias_act_kernel(
    Hin,
    Bias,
    RowExpert,
    Out,
    M,
    I,
    stride_hm,
    stride_hn,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Out[m, n] = act(Hin[m, n] + bias[e_m, n] (gate), Hin[m, I + n] + bias[e_m, I + n] (up)) in fp32."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (cols < I)[None, :]
    h_ptrs = Hin + rows[:, None].to(tl.int64) * stride_hm + cols[None, :] * stride_hn
    v = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e = tl.load(RowExpert + rows, mask=rows < M, other=0).to(tl.int64)
        b_ptrs = Bias + e[:, None] * stride_be + cols[None, :] * stride_bn
        v += tl.load(b_ptrs, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(h_ptrs + I * stride_hn, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(b_ptrs + I * stride_bn, mask=ok, other=0.0).to(tl.float32)
        # interleaved as the fused kernel's accumulator, so both paths share one activation function
        a = _gated_act(tl.reshape(tl.join(v, u), (BLOCK_M, 2 * BLOCK_N)), ACT, BLOCK_M, BLOCK_N)
    else:  # relu^2
        a = tl.maximum(v, 0.0)
        a = a * a
    tl.store(
        Out + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on, a.to(Out.dtype.element_ty), mask=ok
    )


def bias_act_torch(
    h: torch.Tensor, row_expert: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    hf = h.float() if bias is None else h.float() + bias[row_expert.long()].float()
    return activate(hf, activation).to(h.dtype)


def bias_act(h: torch.Tensor, row_expert: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """(P, N1) -> (P, I) in h's dtype: bias of each row's expert, then the activation."""
    gated = GATED[activation]
    M, n1 = h.shape
    inter = n1 // 2 if gated else n1
    out = torch.empty(M, inter, dtype=h.dtype, device=h.device)
    bm, bn = (32, 128) if h.is_cuda else (64, 64)  # interpreter: few programs
    b = bias if bias is not None else h
    _bias_act_kernel[(triton.cdiv(M, bm), triton.cdiv(inter, bn)), h.device](
        h,
        b,
        row_expert,
        out,
        M,
        inter,
        h.stride(0),
        h.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        ACT=ACTIVATIONS[activation],
        GATED=gated,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# weighted top-k sum


@dual_jit
def _topk_sum_kernel(
    Y,
    RowOf,
    TopkIds,
    TopkW,
    Bias,
    Out,
    T,
    H,
    stride_ym,
    stride_yn,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Out[t] = sum_k w[t, k] (Y[row of (t, k)] + bias[e of (t, k)]), fp32, k in order: bit-identical reruns."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = toks < T
    ok = t_ok[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(K):
        p = toks * K + k
        r = tl.load(RowOf + p, mask=t_ok, other=0).to(tl.int64)
        y = tl.load(Y + r[:, None] * stride_ym + cols[None, :] * stride_yn, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(TopkIds + p, mask=t_ok, other=0).to(tl.int64)
            y += tl.load(Bias + e[:, None] * stride_be + cols[None, :] * stride_bn, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(TopkW + p, mask=t_ok, other=0.0)[:, None] * y
    tl.store(
        Out + toks[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on, acc.to(Out.dtype.element_ty), mask=ok
    )


def topk_sum_torch(
    y: torch.Tensor, row_of: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    T, K = topk_ids.shape
    yy = y[row_of.long()].float()
    if bias is not None:
        yy += bias[topk_ids.reshape(-1).long()].float()
    return (yy.view(T, K, -1) * topk_weights.float().view(T, K, 1)).sum(1).to(y.dtype)


def topk_sum(
    y: torch.Tensor, row_of: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y (P, H) in sorted row order, row_of (P,) the row of each pair -> (T, H) in y's dtype."""
    T, K = topk_ids.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    bt, bh = (16, 256) if y.is_cuda else (32, 64)
    b = bias if bias is not None else y
    _topk_sum_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh)), y.device](
        y,
        row_of,
        topk_ids.reshape(-1),
        topk_weights.reshape(-1).float(),
        b,
        out,
        T,
        H,
        y.stride(0),
        y.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        K=K,
        HAS_BIAS=bias is not None,
        BLOCK_T=bt,
        BLOCK_H=bh,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# launcher


def moe_forward_grouped(moe: MoeInputs) -> torch.Tensor:
    """(T, H), as moe.moe_forward; runs moe_forward_triton where grouped_mm_unsupported says why not (warned once
    per reason)."""
    why = grouped_mm_unsupported(moe)
    if why is not None:
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"moe backend grouped_mm: {why}; these runs use the fused Triton kernel", stacklevel=2)
        return moe_forward_triton(moe)
    x, lora = moe.x, moe.lora
    check_kernel_rank(lora.max_rank if lora is not None else 0)
    T, K = moe.topk_ids.shape
    E = moe.w_gate_up.shape[0]
    P = T * K
    row_pair, row_expert, offs = sort_by_expert(moe.topk_ids, E)
    tok = row_pair // K
    xg = x[tok]
    h = grouped_gemm(xg, moe.w_gate_up, offs)
    if lora is not None:
        assert moe.token_adapter is not None  # MoeInputs checked it
        blocks, cfg1, cfg2 = plan_lora(row_expert, moe.token_adapter[tok], lora, E, (h.shape[1], x.shape[1]))
        add_lora_delta(h, xg, lora.gate_up_a, lora.gate_up_b, lora, blocks, moe.w_gate_up, cfg1)
    del xg
    act = bias_act(h, row_expert, moe.b_gate_up, moe.activation)
    del h
    y = grouped_gemm(act, moe.w_down, offs)
    if lora is not None:
        add_lora_delta(y, act, lora.down_a, lora.down_b, lora, blocks, moe.w_down, cfg2)
    row_of = torch.empty_like(row_pair)
    row_of[row_pair] = torch.arange(P, dtype=row_pair.dtype, device=x.device)
    return topk_sum(y, row_of, moe.topk_ids, moe.topk_weights, moe.b_down)
