"""Mamba-2's sequence ops over padded (B, L, ...) prompt batches, in torch: the causal depthwise conv1d, the chunked
SSD scan (state-space duality: quadratic attention-like form inside a chunk, a linear recurrence over chunk states)
and the gated RMSNorm with groups. Each prompt is one row, so every conv window and every scan state starts at the
prompt's first token (the per-prompt reset a packed batch needs); the caller maps packed tokens to rows and back.

These are the CPU path and the reference of any GPU kernel. The maths is the chunked SSD of Dao & Gu, "Transformers
are SSMs" (2024), section 7 ("ssd_minimal"), in the rounding transformers' torch fallback for Nemotron-H uses
(modeling_nemotron_h.mamba2_chunk_scan: fp32 throughout, dt = clamp(softplus(dt + dt_bias)), B/C repeated from
groups to heads, D skip on the undiscretised x), so that fp32 runs agree with HF to ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = "silu"
) -> torch.Tensor:
    """x (B, L, C), weight (C, K), bias (C,) -> (B, L, C): out[t] = act(bias + sum_j weight[:, K-1-j] * x[t-j]),
    with x before the row's first token taken as zero. Computed in weight's dtype, returned in x's."""
    K = weight.shape[1]
    C = x.shape[2]
    xt = x.transpose(1, 2).to(weight.dtype)
    out = F.conv1d(xt, weight.unsqueeze(1), bias, padding=K - 1, groups=C)[..., : x.shape[1]]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"conv activation {activation!r} is not supported (Nemotron-H uses 'silu')")
    return out.transpose(1, 2).to(x.dtype)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a (..., Q) -> (..., Q, Q): out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal. Summed from
    the masked values rather than as cumsum[i] - cumsum[j]: the difference of two large cumulative sums would
    lose the small ones' digits (the decay exponents of a 128-token chunk reach |sum| ~ 1e2)."""
    Q = a.shape[-1]
    x = a[..., None].expand(*a.shape, Q)  # x[..., i, j] = a[i]
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0)
    out = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


def discretise_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float = 0.0, dt_max: float = float("inf")
) -> torch.Tensor:
    """dt (B, L, h) raw from in_proj -> clamp(softplus(dt + dt_bias), dt_min, dt_max) in dt's dtype."""
    return torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), min=dt_min, max=dt_max)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_state: bool = False,
):
    """The SSM y_t = C_t . h_t + D x_t, h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, chunked.

    x (b, l, h, p); dt (b, l, h) already discretised (discretise_dt); A (h,) negative; B, C (b, l, g, n) with h a
    multiple of g; D (h,). initial_state (b, h, p, n) or None (zeros). -> y (b, l, h, p) fp32 [, final state
    (b, h, p, n) fp32 at the row's padded end: pass rows of equal real length when the state is wanted]."""
    b, l, h, p = x.shape
    g = B.shape[2]
    pad = -l % chunk
    xf = x.float()
    Bf = B.float().repeat_interleave(h // g, dim=2)
    Cf = C.float().repeat_interleave(h // g, dim=2)
    a = A.float()[None, None, :] * dt.float()  # (b, l, h): log of the per-step decay
    xdt = xf * dt.float()[..., None]

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (b, l, ...) -> (b, c, Q, ...), zero-padded at the end
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(b, -1, chunk, *t.shape[2:])

    xdt, a, Bf, Cf = chunks(xdt), chunks(a), chunks(Bf), chunks(Cf)
    a = a.permute(0, 3, 1, 2)  # (b, h, c, Q)
    a_cum = torch.cumsum(a, dim=-1)

    # 1. within each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j
    decay = torch.exp(segsum(a))  # (b, h, c, Q, Q)
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cf, Bf) * decay
    y_diag = torch.einsum("bhcij,bcjhp->bcihp", scores, xdt)

    # 2. each chunk's own contribution to the state at its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (b, h, c, Q)
    states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bf, to_end, xdt)

    # 3. the recurrence over chunk boundaries: the state entering each chunk
    if initial_state is None:
        initial_state = torch.zeros_like(states[:, :1])
    else:
        initial_state = initial_state.float()[:, None]
    states = torch.cat([initial_state, states], dim=1)  # (b, c+1, h, p, n)
    chunk_decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # (b, h, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. the entering state read out at each position of its chunk
    y_off = torch.einsum("bcihn,bchpn,bhci->bcihp", Cf, entering, torch.exp(a_cum))

    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :l]
    if D is not None:
        y = y + D.float()[:, None] * xf
    return (y, final) if return_state else y
