"""RMSNorm in the two rounding orders the supported models use."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """Normalise in fp32. Qwen casts back first and then multiplies by the weight in the model dtype;
    gpt-oss keeps its weight in fp32 and multiplies before casting back (``weight_fp32``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_fp32:
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)
