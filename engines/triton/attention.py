"""Attention for packed prefill: q|k|v in one LoRA-aware GEMM, optional per-head q/k RMSNorm, rope, SDPA over the
right-padded view, o projection (row-parallel under TP).

Attention sinks (gpt-oss) add one learned logit per head to every softmax row. SDPA has no such input, so the sink
becomes one extra key that every query sees: q gets a constant-1 extra dimension, the sink key is zero except
sink/scale there, and its value is zero. Then q'.k_sink * scale = sink exactly (scale is a power of two for
head_dim 64) and the sink only enlarges the softmax denominator, which is what transformers' eager path computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.triton.batch import Batch
from engines.triton.norm import rms_norm


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved rotary embedding on (T, heads, d): halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, scale: float, window: int | None,
         sinks: torch.Tensor | None) -> torch.Tensor:
    """q (T, h, d), k/v (T, h_kv, d) -> (T, h, d), causal within each prompt."""
    h, d = q.shape[1], q.shape[2]
    rep = h // k.shape[1]
    qp, kp, vp = (batch.pad(t).transpose(1, 2) for t in (q, k, v))  # (B, heads, L, d)
    if rep > 1:
        kp, vp = kp.repeat_interleave(rep, dim=1), vp.repeat_interleave(rep, dim=1)
    if window is None and sinks is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    else:
        if sinks is not None:
            qp, kp, vp = _with_sink_key(qp, kp, vp, sinks, scale)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.mask(window, sinks is not None),
                                             scale=scale)[..., :d]
    return batch.unpad(out.transpose(1, 2))


def _with_sink_key(q, k, v, sinks, scale):
    B, h, L, d = q.shape
    width = (d + 1 + 7) // 8 * 8  # one extra dimension, padded with zeros to a width the fused kernels take
    q2 = q.new_zeros(B, h, L, width)
    q2[..., :d], q2[..., d] = q, 1.0
    k2 = k.new_zeros(B, h, L + 1, width)
    k2[:, :, 1:, :d] = k
    k2[:, :, 0, d] = (sinks.float() / scale).to(k.dtype)[None, :]
    v2 = v.new_zeros(B, h, L + 1, width)
    v2[:, :, 1:, :d] = v
    return q2, k2, v2
