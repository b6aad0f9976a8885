"""The log-probability of each row's target token over a (N, V) logit matrix, in one pass over the logits: an
online logsumexp in fp32 over bf16/fp16/fp32 logits, with the target's logit read in the same program.

Shapes: N rows (positions), V vocabulary.

Why a kernel: the runtime's chunked log-softmax took 9.4 ms per 4096 tokens at Qwen3-30B-A3B's vocabulary (151936)
on an H200, of which the lm_head GEMM is ~3.2 ms; the rest was the fp32 copy of every logit chunk and the passes of
logsumexp over it (benchmarks/results/e2e.md). Reading the model-dtype logits once removes both.
"""

from __future__ import annotations

import torch

from lpdiff.kernels._triton import dual_jit, resolve_impl, tl, triton

DEFAULT_BLOCK_V = 4096


def target_logprobs_torch(logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Reference: logits (N, V) any float dtype, targets (N,) -> (N,) fp32 log softmax(scale * logits)[target]."""
    x = logits.float()
    if scale != 1.0:
        x = x * scale
    return (x.gather(1, targets[:, None].long()) - torch.logsumexp(x, dim=-1, keepdim=True))[:, 0]


if triton is not None:

    @dual_jit
    def _target_logprobs_kernel(
        logits_ptr, stride_row, targets_ptr, out_ptr, scale, V: tl.constexpr, BLOCK_V: tl.constexpr
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        # one running max for the row, raised a block at a time: one exp per logit (a max per lane needed two, the
        # rescale of every lane's sum and the logit's; at 4096 x 201088 logits that is 1.65 G exps, ~0.5 ms of an
        # H200's special-function units, more than the 0.40 ms its logits take to read). It starts finite, so a
        # lane past V (x = -inf) adds exp(-inf) = 0 instead of exp(-inf - -inf) = NaN.
        m = tl.full([], -1e30, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):  # V is constexpr: the interpreter needs a static trip count
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * scale
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        logz = m + tl.log(tl.sum(s, axis=0))
        t = tl.load(targets_ptr + row)
        xt = tl.load(base + t).to(tl.float32) * scale
        tl.store(out_ptr + row, xt - logz)


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0, impl: str = "auto", block_v: int = DEFAULT_BLOCK_V
) -> torch.Tensor:
    """logits (N, V) with unit stride along V, targets (N,) integer ids in [0, V) -> (N,) fp32 logprobs."""
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be (N, V) with contiguous rows, got shape {tuple(logits.shape)} strides {logits.stride()}"
        )
    n, v = logits.shape
    if targets.shape != (n,):
        raise ValueError(f"targets must be (N={n},), got {tuple(targets.shape)}")
    if resolve_impl(impl, logits) == "torch" or n == 0:
        return target_logprobs_torch(logits, targets, scale)
    assert block_v & (block_v - 1) == 0, "block_v must be a power of two"
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    _target_logprobs_kernel[(n,), logits.device](
        logits, logits.stride(0), targets, out, float(scale), V=v, BLOCK_V=block_v, num_warps=8
    )
    return out
