"""Causal self-attention over a packed batch, with optional sliding window (gpt-oss, alternate layers) and attention
sinks (gpt-oss: one learned logit per head that joins every softmax row but has no value).

Three paths, each exact for what it computes:
- bf16/fp16 on CUDA ("auto"): kernels/attention.py's Triton kernel on the packed tokens (no padding; GQA, window,
  causality and sinks inside the kernel, q/k/v read in place from the q|k|v output). gpt-oss-20b, 8 x 512 tokens,
  H200 (benchmarks/results/kernels.md): 75.8 / 80.4 us per sliding / full layer against 288 / 324 us for
  "flash"; the full-depth bf16 call 60.6k -> 64.1k tokens/s with LoRA (measured at 128 x 64 tiles, before the
  kernel's current 64 x 64).
- "flash": torch's private FlashAttention-2 varlen op (``aten._flash_attention_forward``), which returns each row's
  logsumexp L, so a sink s enters as out * exp(L) / (exp(L) + exp(s)) = out * sigmoid(L - s) in fp32 after it.
  "auto" used it before the Triton kernel measured faster (above).
- fp32 (IEEE, for parity verdicts), CPU, ``attention="sdpa"``, or plain causal attention (no sinks, no window)
  over prompts of nearly one length: torch SDPA over the right-padded (B, L_max) view. For plain causal attention
  SDPA's kernels beat the others when padding is small: Qwen3-30B-A3B, 8 x 512 tokens, bf16, H200: 56 us per
  layer against 87.5 us for the Triton kernel and 139 us for "flash".
  The sink becomes one extra key that every query sees: q gets a constant-1 extra dimension, the sink key is zero
  except sink/scale there, and its value is zero, so q'.k_sink * scale = sink and the sink only enlarges the
  softmax denominator, which is what transformers' eager path computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lpdiff.engines.triton.batch import Batch
from lpdiff.kernels import attention as kernels_attention


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: Batch,
    scale: float,
    window: int | None,
    sinks: Tensor | None,
    impl: str = "auto",
) -> Tensor:
    """q (T, h, d), k/v (T, h_kv, d) -> (T, h, d), causal within each prompt. ``impl``: auto | triton | flash |
    sdpa (module docstring); "triton" on CPU tensors runs the kernel interpreted."""
    if impl == "auto":
        half = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
        impl = "triton" if half and not padded_sdpa_pays(batch, window, sinks) else "sdpa"
    if impl == "triton":
        return kernels_attention.attention(
            q, k, v, batch.cu_seqlens, batch.max_len, scale, window, sinks, impl="triton"
        )
    if impl == "flash" and flash_works(q.device, q.dtype, q.shape[-1]):
        return flash_varlen(q, k, v, batch, scale, window, sinks)
    return sdpa(q, k, v, batch, scale, window, sinks)


MAX_PADDING = 0.2  # share of the padded (B, L_max) view that is padding, up to which SDPA still pays


def padded_sdpa_pays(batch: Batch, window: int | None, sinks: Tensor | None) -> bool:
    """Plain causal attention (no sinks, no window) over prompts of nearly one length: SDPA's padded batch is faster
    than the varlen kernels (module docstring); the padding it computes grows with the spread of prompt lengths."""
    if sinks is not None or window is not None:
        return False
    return 1 - batch.num_tokens / (len(batch.lens) * batch.max_len) <= MAX_PADDING


_FLASH_OK: dict = {}


def flash_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """``aten._flash_attention_forward`` is private API: check it once per (device, dtype, head_dim) on a small
    ragged batch with window, sinks and GQA against fp32 SDPA; if it fails or disagrees, "flash" runs SDPA."""
    key = (str(device), dtype, head_dim)
    if key not in _FLASH_OK:
        import warnings

        lens, h, hkv = [3, 40, 17], 4, 2
        ids = torch.cat([torch.arange(n) for n in lens])
        cu = torch.tensor([0, 3, 43, 60], dtype=torch.int32, device=device)
        fake = Batch(
            ids.to(device),
            ids.to(device),
            torch.repeat_interleave(torch.arange(3), torch.tensor(lens)).to(device),
            lens,
            cu,
            None,
            torch.zeros(0, device=device),  # cos and sin: attention reads no rope
            torch.zeros(0, device=device),
        )
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(60, n, head_dim, generator=g, device=device) for n in (h, hkv, hkv))
        sinks = torch.randn(h, generator=g, device=device)
        try:
            ref = sdpa(q, k, v, fake, head_dim**-0.5, 8, sinks)
            got = flash_varlen(q.to(dtype), k.to(dtype), v.to(dtype), fake, head_dim**-0.5, 8, sinks.to(dtype))
            err = ((got.float() - ref).norm() / ref.norm()).item()
            _FLASH_OK[key] = err < 2e-2
            why = f"relative error {err:.3g}"
        except Exception as e:  # noqa: BLE001 - any failure of the private op means: do not use it
            _FLASH_OK[key], why = False, repr(e)
        if not _FLASH_OK[key]:
            warnings.warn(
                f"FlashAttention varlen check failed on {device} ({why}); the triton engine uses SDPA", stacklevel=2
            )
    return _FLASH_OK[key]


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, batch: Batch, scale: float, window: int | None, sinks: Tensor | None):
    _T, _h, _ = q.shape
    win = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    out, lse = torch.ops.aten._flash_attention_forward(
        q,
        k.contiguous(),
        v.contiguous(),
        batch.cu_seqlens,
        batch.cu_seqlens,
        batch.max_len,
        batch.max_len,
        0.0,
        True,
        False,
        scale=scale,
        **win,
    )[:2]
    if sinks is None:
        return out
    # (h, T) from the unpadded varlen kernel; (B, h, L_max) from kernels that keep a padded layout
    lse = lse if lse.dim() == 2 else batch.unpad(lse.transpose(1, 2)).T
    keep = torch.sigmoid(lse.float() - sinks.float()[:, None]).T  # (T, h): share of mass not taken by the sink
    return (out.float() * keep[..., None]).to(out.dtype)


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, batch: Batch, scale: float, window: int | None, sinks: Tensor | None
) -> Tensor:
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
