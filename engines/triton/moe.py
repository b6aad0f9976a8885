"""Sparse MoE block: router GEMM in torch + one small Triton kernel after it (replicated on every rank; softmax
routers in route(), Nemotron-H's sigmoid router in route_sigmoid()), experts through the fused MoE-LoRA kernel
(experts sharded on their width under TP; the caller all-reduces the partial outputs).

Shapes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from lpdiff.engines.triton._jit import INTERPRETED, pow2, tl, triton, use_triton
from lpdiff.harness.spec.routing import topk_margin
from lpdiff.kernels import MoeInputs, moe_forward


def route_torch(logits: torch.Tensor, k: int, softmax_all: bool, norm_topk: bool):
    """Reference, rounding as transformers: Qwen takes the softmax over all experts in fp32, renormalises the top-k
    and casts the weights to the model dtype; gpt-oss takes top-k on the logits and a softmax over those k in the
    model dtype. The margin is the logit gap between the k-th and (k+1)-th expert (harness.routing's definition)."""
    if softmax_all:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, k, dim=-1)
        if norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = top.to(logits.dtype)
    else:
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    if k < logits.shape[-1]:
        margin = topk_margin(logits.float(), k)
    else:
        margin = torch.full((logits.shape[0],), float("inf"), device=logits.device)
    return ids, weights.float(), margin


def route_sigmoid_torch(
    logits: torch.Tensor, bias: torch.Tensor, k: int, norm_topk: bool, scaling: float, groups: tuple[int, int] = (1, 1)
):
    """Reference of Nemotron-H's router on its fp32 logits, rounding as transformers' NemotronHTopkRouter: sigmoid
    scores, the correction bias added for the choice only, with ``groups`` (n_group, topk_group) the top-topk_group
    groups by the sum of their two best biased scores, top-k inside them; weights the unbiased scores of the chosen
    experts, renormalised with +1e-20 when norm_topk, times ``scaling``. The margin is the gap between the k-th and
    (k+1)-th biased score over all experts (harness.routing's definition for sigmoid routers)."""
    scores = logits.sigmoid()
    choice = scores + bias
    margin = topk_margin(choice, k) if k < choice.shape[-1] else torch.full_like(scores[:, 0], float("inf"))
    pick = choice
    n_group, topk_group = groups
    if n_group > 1 and topk_group < n_group:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        pick = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(T, E), float("-inf"))
    ids = pick.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling, margin


if triton is not None:
    from lpdiff.engines.triton.norm import torch_sigmoid

    @triton.jit
    def _route_kernel(
        Logits,
        Ids,
        Weights,
        Margin,
        T,
        E,
        stride_l,
        K: tl.constexpr,
        SOFTMAX_ALL: tl.constexpr,
        NORM_TOPK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        MIN_INTO: tl.constexpr = False,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        cols = tl.arange(0, BLOCK_E)[None, :]
        kcols = tl.arange(0, BLOCK_K)[None, :]
        raw = tl.load(
            Logits + rows[:, None].to(tl.int64) * stride_l + cols,
            mask=row_ok[:, None] & (cols < E),
            other=-float("inf"),
        )
        logits = raw.to(tl.float32)
        vals = logits
        top = tl.full((BLOCK_T, BLOCK_K), -float("inf"), tl.float32)
        ids = tl.full((BLOCK_T, BLOCK_K), 0, tl.int64)
        for k in tl.static_range(K):  # K rounds of argmax: first index wins ties
            m = tl.max(vals, axis=1)
            i = tl.min(tl.where(vals == m[:, None], cols, BLOCK_E), axis=1)
            top = tl.where(kcols == k, m[:, None], top)
            ids = tl.where(kcols == k, i[:, None].to(tl.int64), ids)
            vals = tl.where(cols == i[:, None], -float("inf"), vals)
        kth = tl.max(tl.where(kcols == K - 1, top, -float("inf")), axis=1)
        margin = kth - tl.max(vals, axis=1)  # + inf when K == E (nothing left to compete)
        m0 = tl.max(top, axis=1)[:, None]
        w = tl.where(kcols < K, tl.exp(top - m0), 0.0)
        if SOFTMAX_ALL and not NORM_TOPK:
            denom = tl.sum(tl.exp(logits - m0), axis=1)
        else:
            denom = tl.sum(w, axis=1)
        w = (w / denom[:, None]).to(raw.dtype).to(tl.float32)  # weights rounded to the model dtype, as HF
        out = rows[:, None] * K + kcols
        ok = row_ok[:, None] & (kcols < K)
        tl.store(Ids + out, ids, mask=ok)
        tl.store(Weights + out, w, mask=ok)
        if MIN_INTO:  # Margin holds the smallest margin of the layers before: keep the minimum
            margin = tl.minimum(margin, tl.load(Margin + rows, mask=row_ok, other=0.0))
        tl.store(Margin + rows, margin, mask=row_ok)

    @triton.jit
    def _route_sigmoid_kernel(
        Logits,
        Bias,
        Ids,
        Weights,
        Margin,
        T,
        E,
        stride_l,
        scaling,
        K: tl.constexpr,
        NORM_TOPK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        MIN_INTO: tl.constexpr = False,
        EXACT: tl.constexpr = True,
    ):
        """route_sigmoid_torch without groups, for BLOCK_T rows of fp32 logits per program."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        cols = tl.arange(0, BLOCK_E)[None, :]
        kcols = tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(
            Logits + rows[:, None].to(tl.int64) * stride_l + cols, mask=row_ok[:, None] & (cols < E), other=0.0
        ).to(tl.float32)
        scores = torch_sigmoid(x, EXACT)  # torch's CUDA bits when compiled: the same scores as the reference
        bias = tl.load(Bias + cols, mask=cols < E, other=0.0).to(tl.float32)
        vals = tl.where(cols < E, scores + bias, -float("inf"))
        w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int64)
        kth = tl.zeros((BLOCK_T,), tl.float32)
        for k in tl.static_range(K):  # K rounds of argmax on the biased choice: first index wins ties
            m = tl.max(vals, axis=1)
            # clamped: a NaN row matches no column, and an id past E would send the experts out of bounds
            i = tl.minimum(tl.min(tl.where(vals == m[:, None], cols, BLOCK_E), axis=1), E - 1)
            hit = cols == i[:, None]
            s = tl.max(tl.where(hit, scores, -float("inf")), axis=1)  # the unbiased score weighs the expert
            w = tl.where(kcols == k, s[:, None], w)
            ids = tl.where(kcols == k, i[:, None].to(tl.int64), ids)
            vals = tl.where(hit, -float("inf"), vals)
            kth = m
        margin = kth - tl.max(vals, axis=1)  # + inf when K == E (nothing left to compete)
        if NORM_TOPK:
            w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None] + 1e-20)
        w = w * scaling
        out = rows[:, None] * K + kcols
        ok = row_ok[:, None] & (kcols < K)
        tl.store(Ids + out, ids, mask=ok)
        tl.store(Weights + out, w, mask=ok)
        if MIN_INTO:
            margin = tl.minimum(margin, tl.load(Margin + rows, mask=row_ok, other=0.0))
        tl.store(Margin + rows, margin, mask=row_ok)


# engines/triton/routing.py's capture (engine option capture_routing): while it is a list, every MoE layer's routing
# is appended to it as (ids, weights, that layer's own margin)
recording: list | None = None


def record(ids: torch.Tensor, weights: torch.Tensor, margin: torch.Tensor) -> None:
    """Keep one MoE layer's routing while a capture is on (a router outside route() calls it too)."""
    if recording is not None:
        recording.append((ids, weights, margin))


class RouterWeights(Protocol):
    """What route() reads of a layer's weights (the shared decoder's LayerWeights, Qwen3.5's MoeWeights)."""

    @property
    def router(self) -> torch.Tensor: ...
    @property
    def router_bias(self) -> torch.Tensor | None: ...


class RouterConfig(Protocol):
    """What route() reads of a model's config (ModelConfig, Qwen35Config)."""

    @property
    def router(self) -> str: ...
    @property
    def top_k(self) -> int: ...
    @property
    def norm_topk_prob(self) -> bool: ...


class ExpertWeights(Protocol):
    """What experts() reads of a layer's weights."""

    @property
    def w_gate_up(self) -> torch.Tensor: ...
    @property
    def w_down(self) -> torch.Tensor: ...
    @property
    def b_gate_up(self) -> torch.Tensor | None: ...
    @property
    def b_down(self) -> torch.Tensor | None: ...


class ExpertConfig(Protocol):
    @property
    def activation(self) -> str: ...


def route(
    x: torch.Tensor, w: RouterWeights, cfg: RouterConfig, impl: str = "auto", min_into: torch.Tensor | None = None
):
    """-> topk ids (T, K) int64, topk weights (T, K) float32, routing margin (T,) float32.
    min_into (T,) float32: the running minimum of earlier layers' margins, updated in place and returned as the
    margin (the kernel does it in its store: one launch fewer per layer on a host-bound forward)."""
    if recording is not None and min_into is not None:  # a capture keeps this layer's own margin
        ids, weights, margin = route(x, w, cfg, impl)
        return ids, weights, torch.minimum(min_into, margin, out=min_into)
    logits = F.linear(x, w.router, w.router_bias)
    softmax_all = cfg.router == "softmax_topk"
    if not use_triton(x, impl):
        ids, weights, margin = route_torch(logits, cfg.top_k, softmax_all, cfg.norm_topk_prob)
        record(ids, weights, margin)
        return ids, weights, margin if min_into is None else torch.minimum(min_into, margin, out=min_into)
    T, E = logits.shape
    K = cfg.top_k
    ids = torch.empty(T, K, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, K, dtype=torch.float32, device=x.device)
    margin = torch.empty(T, dtype=torch.float32, device=x.device) if min_into is None else min_into
    block_t = 16
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits,
        ids,
        weights,
        margin,
        T,
        E,
        logits.stride(0),
        K=K,
        SOFTMAX_ALL=softmax_all,
        NORM_TOPK=cfg.norm_topk_prob,
        BLOCK_T=block_t,
        BLOCK_E=pow2(E),
        BLOCK_K=pow2(K),
        MIN_INTO=min_into is not None,
        num_warps=4,
    )
    record(ids, weights, margin)
    return ids, weights, margin


def route_sigmoid(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    norm_topk: bool,
    scaling: float,
    groups: tuple[int, int] = (1, 1),
    impl: str = "auto",
    min_into: torch.Tensor | None = None,
):
    """Nemotron-H's router after its fp32 GEMM (route_sigmoid_torch's arguments; the GEMM stays in torch, IEEE fp32
    as transformers') -> ids (T, K) int64, weights (T, K) fp32, margin (T,) fp32; min_into as route()'s. One kernel
    instead of torch's sigmoid, bias add, two top-k and the weights' gather / sum / divide / scale (torch.topk's
    radix select over 512 experts alone was 3.7 ms of an H200 profile of Super's 19 MoE layers at 4096 tokens);
    group-limited routing (topk_group < n_group) keeps the torch path."""
    if recording is not None and min_into is not None:  # a capture keeps this layer's own margin
        ids, weights, margin = route_sigmoid(logits, bias, k, norm_topk, scaling, groups, impl)
        return ids, weights, torch.minimum(min_into, margin, out=min_into)
    if not use_triton(logits, impl) or (groups[0] > 1 and groups[1] < groups[0]):
        ids, weights, margin = route_sigmoid_torch(logits, bias, k, norm_topk, scaling, groups)
        record(ids, weights, margin)
        return ids, weights, margin if min_into is None else torch.minimum(min_into, margin, out=min_into)
    logits, bias = logits.contiguous(), bias.contiguous()
    T, E = logits.shape
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    margin = torch.empty(T, dtype=torch.float32, device=logits.device) if min_into is None else min_into
    block_e = pow2(E)
    # scores and the biased choice stay in registers through the K rounds, (BLOCK_T, BLOCK_E) fp32 each. Up to 128
    # experts: 2048 elements a tensor over 4 warps (Nano's 128 x top-6: 19 us a layer on an H200, T 4096). From 256:
    # one row per one-warp program, so that each round's reductions stay in the warp: 4 rows over 4 warps spread a
    # row over the warps, 206 barriers a program in the sm_90 PTX, and Super's 512 x top-22 took 119 us a layer on
    # the H200; one warp, one row: 1 barrier, 96 registers, no spill (ptxas, triton 3.6; not yet timed)
    wide = block_e >= 256
    block_t = 1 if wide else max(1, min(16, 2048 // block_e))
    _route_sigmoid_kernel[(triton.cdiv(T, block_t),)](
        logits,
        bias,
        ids,
        weights,
        margin,
        T,
        E,
        logits.stride(0),
        float(scaling),
        K=k,
        NORM_TOPK=norm_topk,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=pow2(k),
        MIN_INTO=min_into is not None,
        EXACT=not INTERPRETED,
        num_warps=1 if wide else 4,
    )
    record(ids, weights, margin)
    return ids, weights, margin


def experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w: ExpertWeights,
    cfg: ExpertConfig,
    lora,
    token_adapter: torch.Tensor | None,
    impl: str,
    backend: str = "triton",
    sum_topk: bool = True,
    shrink: tuple = ("auto", None),
    padding: str | None = None,
) -> torch.Tensor:
    """(T, H), or with sum_topk False on the paths that can skip the sum (kernels.moe_forward) the weighted
    per-pair outputs (T, K, H) for the next residual add + RMSNorm to sum (norm.add_rms_norm).
    shrink: (lora_shrink, n_tiles) of kernels.moe_forward (the engine's moe_lora_shrink option,
    options.parse_shrink); padding: its padding (the engine's moe_padding option; kernels.PADDING)."""
    use_lora = lora is not None and token_adapter is not None
    return moe_forward(
        MoeInputs(
            x,
            ids,
            weights,
            w.w_gate_up,
            w.w_down,
            cfg.activation,
            w.b_gate_up,
            w.b_down,
            lora if use_lora else None,
            token_adapter if use_lora else None,
        ),
        impl=impl,
        backend=backend,
        sum_topk=sum_topk,
        lora_shrink=shrink[0],
        n_tiles=shrink[1] if use_lora else None,
        padding=padding,
    )
