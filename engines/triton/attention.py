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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, scale: float, window: int | None,
         sinks: torch.Tensor | None) -> torch.Tensor:
    """q (T, h, d), k/v (T, h_kv, d) -> (T, h, d), causal within each prompt."""
    h, d = q.shape[1], q.shape[2]
    rep = h // k.shape[1]
    qp, kp, vp = (batch.pad(t).transpose(1, 2) for t in (q, k, v))  # (B, heads, L, d)
    if sinks is not None:
        qp, kp, vp = _with_sink_key(qp, kp, vp, sinks, scale)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.mask(window, True), scale=scale)
    elif window is not None:
        kp, vp = kp.repeat_interleave(rep, dim=1), vp.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.mask(window, False), scale=scale)
    else:  # plain causal: the flash kernels read the shared kv heads themselves
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=rep > 1)
    return batch.unpad(out[..., :d].transpose(1, 2))


def _with_sink_key(q, k, v, sinks, scale):
    """(B, h, L, d) q and (B, h_kv, L, d) k/v -> q, k, v of width d+1 (padded to a multiple of 8) with the sink key
    in front; kv heads are expanded to the query heads here (each query head has its own sink)."""
    B, h, L, d = q.shape
    hkv = k.shape[1]
    width = (d + 1 + 7) // 8 * 8  # one extra dimension, padded with zeros to a width the fused kernels take
    q2 = q.new_zeros(B, h, L, width)
    q2[..., :d], q2[..., d] = q, 1.0
    k2 = k.new_zeros(B, hkv, h // hkv, L + 1, width)
    k2[:, :, :, 1:, :d] = k[:, :, None]
    k2 = k2.view(B, h, L + 1, width)
    k2[:, :, 0, d] = (sinks.float() / scale).to(k.dtype)[None, :]
    v2 = v.new_zeros(B, hkv, h // hkv, L + 1, width)
    v2[:, :, :, 1:, :d] = v[:, :, None]
    return q2, k2, v2.view(B, h, L + 1, width)
