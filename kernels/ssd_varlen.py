"""Mamba-2's conv1d and SSD scan over packed prompts (no padding) as Triton kernels, each with its torch reference
beside it: ssd.py's padded ops applied to the prompts laid out one per row.

- ``causal_conv1d_varlen``: one program per (token block, channel block); tap j reads token t - j only when t's
  position in its prompt is >= j, so no window crosses a prompt boundary.
- ``ssd_scan_varlen``: the SSM as its recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t,
  one program per (prompt, head, block of head_dim rows), the (rows, state) tile held in registers and walked over
  the prompt's tokens, so each prompt starts from a zero state. It is the same linear map as the chunked form the
  reference computes (ssd.ssd_scan); fp32 throughout, the two differ by rounding only (~1e-6 relative).

Why keep a recurrence beside mamba_ssm's chunked SSD kernels (vendored, run by ssd_chunked.py when the engine's
mamba_scan option says so): it is one short kernel, exact in fp32 (its state and products in fp32, no TF32 dots),
which the fp32 parity runs need. It is latency-bound per token (a prompt of L tokens is L dependent steps), which
the chunked kernels avoid on long prompts: benchmarks/bench_ssd.py times the two.
"""

from __future__ import annotations

import itertools

import torch

from lpdiff.kernels._triton import dual_jit, next_pow2, resolve_impl, tl, triton
from lpdiff.kernels.ssd import causal_conv1d, ssd_scan


def _rows(cu_seqlens: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """-> (lengths, row of each token, position of each token) of the packed prompts (host lengths: reference only)."""
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in itertools.pairwise(cu)]
    dev = cu_seqlens.device
    seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
    pos = torch.arange(cu[-1], device=dev) - torch.tensor(cu[:-1], device=dev)[seq]
    return lens, seq, pos


def _pad(t: torch.Tensor, lens: list[int], seq, pos) -> torch.Tensor:
    out = t.new_zeros(len(lens), max(lens), *t.shape[1:])
    out[seq, pos] = t
    return out


def causal_conv1d_varlen_torch(x, weight, bias, cu_seqlens, activation="silu"):
    lens, seq, pos = _rows(cu_seqlens)
    return causal_conv1d(_pad(x, lens, seq, pos), weight, bias, activation)[seq, pos]


def ssd_scan_varlen_torch(x, dt, A, B, C, D, cu_seqlens, chunk: int = 64):
    lens, seq, pos = _rows(cu_seqlens)
    xp, dtp, Bp, Cp = (_pad(t, lens, seq, pos) for t in (x, dt, B, C))
    y = ssd_scan(xp, dtp, A, Bp, Cp, chunk, D)
    return y[seq, pos]


if triton is not None:

    @dual_jit
    def _conv_kernel(
        X,
        W,
        Bias,
        Out,
        Pos,
        T,
        C,
        stride_x,
        stride_o,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok, col_ok = rows < T, cols < C
        pos = tl.load(Pos + rows, mask=row_ok, other=0)
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(K):
            ok = row_ok & (pos >= j)
            xv = tl.load(
                X + (rows - j).to(tl.int64)[:, None] * stride_x + cols[None, :],
                mask=ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            w = tl.load(W + cols * K + (K - 1 - j), mask=col_ok, other=0.0)
            acc += xv.to(tl.float32) * w.to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(
            Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
            acc.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    @dual_jit
    def _scan_kernel(
        X,
        DT,
        A,
        B,
        C,
        D,
        Y,
        Cu,
        stride_xt,
        stride_xh,
        stride_dt,
        stride_bt,
        stride_bg,
        stride_ct,
        stride_cg,
        stride_yt,
        stride_yh,
        P,
        N,
        HEADS_PER_GROUP: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        seq, head, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = tl.load(Cu + seq), tl.load(Cu + seq + 1)
        group = head // HEADS_PER_GROUP
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        p_ok, n_ok = offs_p < P, offs_n < N
        a = tl.load(A + head).to(tl.float32)
        d = tl.load(D + head).to(tl.float32)
        state = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
        start64 = start.to(tl.int64)
        for i in range(end - start):
            t64 = start64 + i
            dt = tl.load(DT + t64 * stride_dt + head).to(tl.float32)
            x = tl.load(X + t64 * stride_xt + head * stride_xh + offs_p, mask=p_ok, other=0.0).to(tl.float32)
            b = tl.load(B + t64 * stride_bt + group * stride_bg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            c = tl.load(C + t64 * stride_ct + group * stride_cg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
            y = tl.sum(state * c[None, :], axis=1) + d * x
            tl.store(Y + t64 * stride_yt + head * stride_yh + offs_p, y, mask=p_ok)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
    impl: str = "auto",
) -> torch.Tensor:
    """x (T, C) packed prompts, weight (C, K), bias (C,), positions (T,) of each token in its prompt, cu_seqlens
    (S+1,) int32 -> (T, C) in x's dtype: act(bias + sum_j weight[:, K-1-j] * x[t-j]) within each prompt."""
    if activation not in ("silu", None):
        raise ValueError(f"conv activation {activation!r} is not supported (Nemotron-H uses 'silu')")
    if resolve_impl(impl, x) == "torch":
        return causal_conv1d_varlen_torch(x, weight, bias, cu_seqlens, activation)
    T, C = x.shape
    out = torch.empty_like(x)
    block_t, block_c = 16, min(128, next_pow2(C))
    _conv_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c)), x.device](
        x,
        weight.contiguous(),
        bias if bias is not None else weight,
        out,
        positions,
        T,
        C,
        x.stride(0),
        out.stride(0),
        K=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BLOCK_T=block_t,
        BLOCK_C=block_c,
    )
    return out


def ssd_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk: int = 64,
    impl: str = "auto",
) -> torch.Tensor:
    """x (T, h, p), dt (T, h) discretised (ssd.discretise_dt), A (h,), B/C (T, g, n), D (h,), cu_seqlens (S+1,)
    int32 -> y (T, h, p) fp32, each prompt from a zero state. ``chunk``: the reference's chunk size only."""
    if resolve_impl(impl, x) == "torch":
        return ssd_scan_varlen_torch(x, dt, A, B, C, D, cu_seqlens, chunk)
    T, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and dt.stride(1) == 1
    y = torch.empty(T, h, p, dtype=torch.float32, device=x.device)
    block_p = min(32, next_pow2(p, 8))
    _scan_kernel[(cu_seqlens.shape[0] - 1, h, triton.cdiv(p, block_p)), x.device](
        x,
        dt,
        A,
        B,
        C,
        D,
        y,
        cu_seqlens,
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        y.stride(0),
        y.stride(1),
        p,
        n,
        HEADS_PER_GROUP=h // g,
        BLOCK_P=block_p,
        BLOCK_N=next_pow2(n, 8),
    )
    return y
