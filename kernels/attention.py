"""Causal self-attention over packed prompts (variable lengths, no padding), with GQA, an optional sliding window
and optional attention sinks, in one FlashAttention-style Triton kernel; the pure-torch reference beside it.

Shapes: T packed tokens, B prompts (cu_seqlens (B+1,) int32 bounds them), Hq query heads, Hkv kv heads (Hq a
multiple), D head_dim, W window (query i sees keys i-W+1..i of its own prompt, transformers' sliding mask).
Sinks (Hq,): one learned logit per head that joins every softmax row and carries no value (gpt-oss), in logit
units (compared with the scaled q.k), so it only enlarges the denominator.

Why a kernel: gpt-oss's attention (sinks, alternate 128-token windows, 64 heads of 64) ran on torch's private
FlashAttention-2 varlen op plus an fp32 sink correction over its output: ~7 ms of a 69 ms full-depth call on an
H200, against 1.75 ms for SDPA's plain causal attention at the same shapes (benchmarks/sol_forward.py).
Here the sink is the online softmax's starting point (running max = sink, running sum = 1), the window bounds the
key loop, and q/k/v are read in place from the q|k|v GEMM's output (strided views, no copies).
"""

from __future__ import annotations

import itertools
import math

import torch

from lpdiff.kernels._triton import dot_flags, dual_jit, next_pow2, resolve_impl, tl, triton

LOG2E = math.log2(math.e)


def attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D) in q's dtype; each prompt's softmax in fp32 with the
    sink as one more logit in its denominator, as transformers' eager gpt-oss attention."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for s, e in itertools.pairwise(bounds):
        qs = q[s:e].float().transpose(0, 1)  # (Hq, L, D)
        ks, vs = (t[s:e].float().repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
        logits = qs @ ks.transpose(1, 2) * scale  # (Hq, L, L)
        i = torch.arange(e - s, device=q.device)
        ok = i[None, :] <= i[:, None]
        if window is not None:
            ok &= i[None, :] > i[:, None] - window
        logits = logits.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.float()[:, None, None].expand(-1, e - s, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., : e - s]
        out[s:e] = (p @ vs).transpose(0, 1).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _attn_blocks(
        acc,
        l_i,
        m_i,
        q,
        K,
        V,
        offs_m,
        offs_d,
        seqlen,
        lo,
        hi,
        stride_kt,
        stride_vt,
        qk_scale,
        MASK: tl.constexpr,
        WINDOW: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        EVEN_D: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Keys [lo, hi) of one query block into the online softmax. MASK 0: every key visible to every query
        (below the diagonal, inside the window); 1: the diagonal blocks (causal, keys past the prompt's end);
        2: the window's lower edge."""
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < D
        for start_n in range(lo, hi, BLOCK_N):
            kn = start_n + offs_n
            kv_ok = d_ok[None, :]
            if MASK == 1:
                kv_ok = kv_ok & (kn < seqlen)[:, None]
            if EVEN_D and MASK != 1:
                k = tl.load(K + kn[:, None] * stride_kt + offs_d[None, :])  # (BLOCK_N, BLOCK_D)
                v = tl.load(V + kn[:, None] * stride_vt + offs_d[None, :])
            else:
                k = tl.load(K + kn[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
                v = tl.load(V + kn[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
            if MASK == 1:
                ok = (kn[None, :] <= offs_m[:, None]) & (kn < seqlen)[None, :]
                if WINDOW > 0:
                    ok = ok & (offs_m[:, None] - kn[None, :] < WINDOW)
                qk = tl.where(ok, qk, float("-inf"))
            if MASK == 2:
                qk = tl.where(offs_m[:, None] - kn[None, :] < WINDOW, qk, float("-inf"))
            # m_i starts finite (the sink, or -1e30), so a row whose keys are all masked here keeps p = 0, not NaN
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
            m_i = m_new
        return acc, l_i, m_i

    @dual_jit
    def _attention_kernel(
        Q,
        K,
        V,
        Sinks,
        Out,
        CuSeqlens,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        WINDOW: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # query heads vary fastest: the GROUP heads sharing a kv head run side by side and share its tiles in L2
        h = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest (last) query blocks start first
        b = tl.program_id(2)
        start = tl.load(CuSeqlens + b)
        seqlen = tl.load(CuSeqlens + b + 1) - start
        m0 = pid_m * BLOCK_M
        if m0 >= seqlen:
            return
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < seqlen
        start64 = start.to(tl.int64)
        q = tl.load(
            Q + (start64 + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        kh = h // GROUP
        Kh = K + start64 * stride_kt + kh * stride_kh
        Vh = V + start64 * stride_vt + kh * stride_vh
        if HAS_SINKS:  # the sink is the first logit seen: running max = sink, running sum = exp(0) = 1
            m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
            l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
        else:
            m_i = tl.zeros([BLOCK_M], tl.float32) - 1e30
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        EVEN_D: tl.constexpr = BLOCK_D == D
        # keys in up to three runs, one code path each (_attn_blocks' MASK): the window's lower edge [lo, full)
        # (MASK 2, WINDOW only), keys every query sees [full, m0) (MASK 0), the diagonal [m0, m0 + BLOCK_M) (MASK 1)
        full = 0
        if WINDOW > 0:
            # keys the block's first query can see start at m0 - WINDOW + 1; those its last query cannot see end
            # at m0 + BLOCK_M - WINDOW: blocks before that bound are masked, blocks after it are not
            lo = tl.maximum(m0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            full = tl.minimum(tl.maximum((m0 + BLOCK_M - WINDOW + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), m0)
        FIRST_RUN: tl.constexpr = 0 if WINDOW > 0 else 1
        for run in tl.static_range(FIRST_RUN, 3):
            if run == 0:
                k0, k1 = lo, full
            elif run == 1:
                k0, k1 = full, m0
            else:
                k0, k1 = m0, m0 + BLOCK_M
            acc, l_i, m_i = _attn_blocks(
                acc,
                l_i,
                m_i,
                q,
                Kh,
                Vh,
                offs_m,
                offs_d,
                seqlen,
                k0,
                k1,
                stride_kt,
                stride_vt,
                qk_scale,
                (run + 2) % 3,  # MASK of runs 0, 1, 2: 2, 0, 1
                WINDOW,
                D,
                BLOCK_N,
                EVEN_D,
                DOT_PREC,
                UPCAST,
            )
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # rows past the prompt saw no key (l 0 without sinks)
        tl.store(
            Out + (start64 + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & (offs_d < D)[None, :],
        )


def attention_config(head_dim: int, dtype: torch.dtype, cuda: bool) -> dict:
    """Tiles (BLOCK_N must divide BLOCK_M: a query block's unmasked keys end at its first row). On the GPU 64
    queries x 64 keys, 4 warps, 3 stages: the fastest of 8 tilings at gpt-oss-20b's sliding and full layers and at
    Qwen3-30B-A3B's head_dim 128 (H200, bf16, 8 x 512 tokens; benchmarks/results/kernels.md: 75.8 / 80.4 /
    87.5 us per layer against 82.7-134 us for the others); fp32 (parity checks) keeps its tiles small. In the
    interpreter small tiles: the cost is per program step."""
    if not cuda:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    fp32 = dtype == torch.float32
    if head_dim > 128:  # K and V tiles grow with head_dim: fewer keys per step and stages keep them in shared memory
        return dict(BLOCK_M=32 if fp32 else 64, BLOCK_N=16 if fp32 else 32, num_warps=4, num_stages=2)
    if fp32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def check_attention_inputs(q, k, v, cu_seqlens, window, sinks) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"attention wants q (T, Hq, D) and k, v (T, Hkv, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("attention wants the head_dim of q, k and v contiguous (stride 1)")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of prompt bounds, got {cu_seqlens.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (keys per query, itself included) or None, got {window}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head ({q.shape[1]},), got {tuple(sinks.shape)}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    impl: str = "auto",
    config: dict | None = None,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) (strided views are fine: head_dim contiguous), cu_seqlens (B+1,) int32,
    max_len = the longest prompt (sizes the grid, no device sync) -> (T, Hq, D) in q's dtype.
    config: attention_config's keys to override (a tile sweep)."""
    check_attention_inputs(q, k, v, cu_seqlens, window, sinks)
    if resolve_impl(impl, q) == "torch":
        return attention_torch(q, k, v, cu_seqlens, scale, window, sinks)
    T, Hq, D = q.shape
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    cfg = attention_config(D, q.dtype, q.is_cuda) | (config or {})
    if cfg["BLOCK_M"] % cfg["BLOCK_N"]:
        raise ValueError(
            f"BLOCK_N ({cfg['BLOCK_N']}) must divide BLOCK_M ({cfg['BLOCK_M']}): a query block's "
            "unmasked keys end at its first row"
        )
    B = cu_seqlens.shape[0] - 1
    grid = (Hq, triton.cdiv(max_len, cfg["BLOCK_M"]), B)
    _attention_kernel[grid, q.device](
        q,
        k,
        v,
        sinks if sinks is not None else q,
        out,
        cu_seqlens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=Hq // k.shape[1],
        D=D,
        BLOCK_D=next_pow2(D),
        WINDOW=window or 0,
        HAS_SINKS=sinks is not None,
        **cfg,
        **dot_flags(q.dtype, q.device),
    )
    return out
