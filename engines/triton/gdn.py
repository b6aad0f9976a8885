"""Gated DeltaNet's sequence ops (Qwen3.5's linear-attention layers) over a packed batch: the causal depthwise conv1d,
the chunked gated delta rule and the gated RMSNorm. Every prompt starts from a zero conv window and a zero
recurrent state (the per-prompt reset a packed batch needs).

Two implementations of the delta rule:
- "torch" (CPU, fp32 runs, and the reference): our own chunked form below, on the right-padded (B, L_max) view of
  the batch. Right padding is exact: conv and recurrence are causal, so a prompt's real tokens never see the padding
  after them, and each row starts from zeros. Written here rather than calling transformers' torch fallback
  (modeling_qwen3_5_moe.torch_chunk_gated_delta_rule) so that the reference engine and this one do not share one
  implementation (a shared bug would pass every parity test); the arithmetic is the same fp32 chunked WY/UT form,
  so fp32 runs agree with HF to ~1e-6. ``gated_delta_rule_recurrent`` (token by token) checks it in the tests.
- "fla" (16-bit runs on CUDA): fla-core's chunked gated delta rule (pip extra ``fla``, imported lazily) on the packed
  tokens with ``cu_seqlens``, which resets the state at each prompt boundary itself. fp32 runs stay on the torch
  form: fla's Triton dots take fp32 inputs at TF32 precision, which would break the 1e-4 fp32 parity the engine's
  fp32 mode exists for.

CUDA graphs (graphs.py): fla 0.5.2's public chunk_gated_delta_rule derives its chunk indices from ``cu_seqlens`` on
the host (prepare_chunk_indices: ``repeat_interleave`` over device counts reads their sum back, a sync that a capture
refuses) and takes no precomputed ones. So the runtime calls what it calls after its argument checks --
l2norm_fwd on q and k, then chunk_gated_delta_rule_fwd -- with the indices of a ``FlaPlan`` computed from the
batch's host lengths once per batch (the first forward of a layout, i.e. the eager warm-up before a capture). Same
kernels, same inputs (made contiguous, as the public path's input_guard does), so the outputs are the same bits.
The public path's dispatch would pick the FlashQLA backend instead where the ``flash_qla`` package is installed
(SM90/SM100, bf16, K = V = 128); lpdiff does not install it, so that backend is never taken either way.

Inputs on the fla path, as fla wants them with no copy in between:
- q and k stay at their key heads (Qwen3.5-35B-A3B: 16 key heads, 32 value heads): fla 0.5.2's forward kernels
  (kkt/solve, recompute_w_u, fwd_h, fwd_o) read key head ``i_h // (HV // H)`` for value head ``i_h``, the mapping
  ``repeat_interleave(HV // H)`` writes out. The torch form repeats them itself.
- the conv (``causal_conv1d_parts``) runs fla 0.5.2's Triton causal_conv1d (varlen over the plan's cu_seqlens and
  64-token chunk indices, so no window reads across a prompt boundary) once per q / k / v channel group: it reads
  the strided column block of the in projection and writes each group contiguous, the layout l2norm_fwd and the
  delta rule kernels index (they take no strides). Its activation stays a torch SiLU after it: fla's fused SiLU
  would round once where torch's conv then SiLU round twice in 16 bits (transformers' torch conv, HF's reference).
  fp32 runs keep the torch conv, as they keep the torch delta rule.
- with qwen3_5.FUSED_GDN_INPUT (off by default: slower than this chain as tiled, see there) the forward takes
  gdn_conv.conv_silu_l2norm instead: the conv, the SiLU and fla's q/k L2 norm in one pass with the same roundings,
  and the delta rule skips its l2norm_fwd (``qk_normed``). The split conv above is the default path, lpdiff
  bisect's sub-step trace and that pass's reference chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lpdiff.engines.triton.batch import Batch

CHUNK = 64  # tokens per chunk of the torch form (fla uses 64 too)
IMPLS = ("auto", "torch", "fla")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, batch: Batch) -> torch.Tensor:
    """x (T, C) packed, weight (C, K) -> silu(depthwise causal conv) (T, C); each prompt's window starts at zeros.
    Computed in weight's dtype, as transformers' causal_conv1d_fn."""
    xp = batch.pad(x).transpose(1, 2).to(weight.dtype)  # (B, C, L)
    K = weight.shape[1]
    y = F.conv1d(xp, weight.unsqueeze(1), None, padding=K - 1, groups=weight.shape[0])[..., : xp.shape[-1]]
    return batch.unpad(F.silu(y).transpose(1, 2)).to(x.dtype)


def causal_conv1d_parts(
    x: torch.Tensor, weight: torch.Tensor, batch: Batch, widths: list[int], impl: str = "auto"
) -> tuple[torch.Tensor, ...]:
    """x (T, C) packed (a strided column block is fine), weight (C, K) -> silu(causal conv) split into channel groups
    of ``widths`` (T, w): on the fla path each group written contiguous by its own launch; on the torch path views of
    causal_conv1d's output. ``impl`` resolves as the delta rule's (resolve)."""
    if resolve(impl, x) == "fla":
        return _fla_conv(x, weight, widths, fla_plan(batch))
    return causal_conv1d(x, weight, batch).split(widths, dim=-1)


def _fla_conv(x: torch.Tensor, weight: torch.Tensor, widths: list[int], plan: FlaPlan) -> tuple[torch.Tensor, ...]:
    """fla 0.5.2's causal_conv1d_fwd (no bias, no initial state) per channel group with the plan's cu_seqlens and
    chunk indices (its default 64-token chunks, as CHUNK), then the SiLU in place: the conv rounds its fp32 sum to
    x's dtype once, as torch's conv, and the SiLU rounds again, as torch's."""
    from fla.modules.conv.triton.ops import causal_conv1d_fwd

    if weight.dtype != x.dtype:
        raise ValueError(f"the fla conv computes in x's dtype ({x.dtype}); the weight is {weight.dtype}")
    outs, start = [], 0
    for w in widths:
        y, _ = causal_conv1d_fwd(
            x=x[None, :, start : start + w],
            weight=weight[start : start + w],
            bias=None,
            residual=None,
            activation=None,
            cu_seqlens=plan.cu_seqlens,
            chunk_indices=plan.chunk_indices,
            BT=CHUNK,
        )
        outs.append(F.silu(y[0], inplace=True))
        start += w
    return tuple(outs)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """Padded rows, each from a zero state: q/k (B, L, h, dk), v (B, L, h, dv), g (log decay, <= 0) and beta
    (B, L, h) -> o (B, L, h, dv) in v's dtype. q and k are l2-normalised here and q scaled by dk^-0.5.

    Recurrence (state S (dk, dv) per row and head): S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T,
    o_t = S_t^T q_t. Per chunk of C tokens with G = cumsum(g) inside the chunk: the intra-chunk delta updates solve
    one unit lower-triangular system (I + tril_{-1}((beta k) k^T * e^{G_i - G_j})) [u | w] = [beta v | beta k e^G];
    then v' = u - w S, o = (q e^G) S + (q k^T * e^{G_i - G_j}, causal incl. the diagonal) v', and
    S <- e^{G_C} S + (k e^{G_C - G})^T v'."""
    out_dtype = v.dtype
    B, L, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))  # (B, h, L, d)
    g, beta = (t.float().transpose(1, 2) for t in (g, beta))  # (B, h, L)
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    pad = (-L) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(B, h, n, chunk, -1) for t in (q, k, v))
    g, beta = (t.reshape(B, h, n, chunk) for t in (g, beta))
    G = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{G_i - G_j}, i >= j
    kb = k * beta[..., None]
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device)
    uw = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    last = G[..., -1].exp()[..., None, None]  # (B, h, n, 1, 1)
    S = q.new_zeros(B, h, dk, dv)
    o = torch.empty_like(u)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ S
        o[:, :, c] = q_dec[:, :, c] @ S + attn[:, :, c] @ v_new
        S = S * last[:, :, c] + k_dec[:, :, c].transpose(-1, -2) @ v_new
    return o.reshape(B, h, n * chunk, dv)[:, :, :L].transpose(1, 2).to(out_dtype)


def gated_delta_rule_recurrent(q, k, v, g, beta) -> torch.Tensor:
    """Token-by-token reference of chunk_gated_delta_rule_torch (same shapes): the recurrence as its docstring
    writes it, for the tests."""
    B, L, h, dk = k.shape
    q = l2norm(q.float()) * dk**-0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    S = q.new_zeros(B, h, dk, v.shape[-1])
    out = []
    for t in range(L):
        S = S * g[:, t].exp()[..., None, None]
        err = v[:, t] - (S * k[:, t, :, :, None]).sum(-2)
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * err)[..., None, :]
        out.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1)


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(impl: str, x: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"gdn must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "fla" and not fla_available():
        raise ValueError("gdn='fla' needs fla-core: pip install fla-core==0.5.2")
    if impl == "auto":
        low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        return "fla" if low and fla_available() else "torch"
    return impl


def chunk_indices(lens: list[int], chunk: int = CHUNK) -> np.ndarray:
    """(n_chunks, 2) int64: (prompt, chunk within the prompt) for every chunk of ``chunk`` tokens of each prompt,
    prompts in order -- what fla's prepare_chunk_indices computes from cu_seqlens, here from the host's lengths."""
    counts = (np.asarray(lens, dtype=np.int64) + chunk - 1) // chunk
    prompt = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([prompt, within], axis=1)


@dataclass(frozen=True, slots=True)
class FlaPlan:
    """What fla's varlen kernels read of a batch's layout, on the device, built once per batch from its host
    lengths (no device-to-host read, so a CUDA graph can capture the forward that uses it)."""

    cu_seqlens: torch.Tensor  # (B+1,) int64
    chunk_indices: torch.Tensor  # (n_chunks, 2) int64 (chunk_indices above)
    # fla's chunk_gated_delta_rule_fwd_h derives these itself (device ops, no sync) through fla's identity-keyed
    # cache (4 entries): made here once through that cache, so a cache hit inside a capture returns a tensor this
    # plan keeps alive for as long as the graph's batch lives, never a freed one
    chunk_offsets: torch.Tensor | None = None


def fla_plan(batch: Batch, make_offsets: bool = True) -> FlaPlan:
    """The batch's FlaPlan, made on first use and kept in batch.plans."""
    plan = batch.plans.get("fla")
    if plan is None:
        dev = batch.input_ids.device
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(batch.lens)]).astype(np.int64)).to(dev)
        offsets = None
        if make_offsets:
            from fla.ops.utils.index import prepare_chunk_offsets

            offsets = prepare_chunk_offsets(cu, CHUNK)
        plan = batch.plans["fla"] = FlaPlan(cu, torch.from_numpy(chunk_indices(batch.lens)).to(dev), offsets)
    return plan


def _fla(q, k, v, g, beta, plan: FlaPlan, qk_normed: bool = False) -> torch.Tensor:
    """fla 0.5.2's ChunkGatedDeltaRuleFunction.forward for inference (use_qk_l2norm_in_kernel, no initial or final
    state, default scale dk^-0.5, chunk 64) with the plan's chunk indices in place of its host-side ones.
    qk_normed: q and k come L2-normed already (gdn_conv.conv_silu_l2norm), so its l2norm_fwd is skipped."""
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    if qk_normed:
        qn, kn = q[None].contiguous(), k[None].contiguous()
    else:
        from fla.modules.l2norm import l2norm_fwd

        qn, _ = l2norm_fwd(q[None].contiguous())
        kn, _ = l2norm_fwd(k[None].contiguous())
    _, o, *_ = chunk_gated_delta_rule_fwd(
        q=qn,
        k=kn,
        v=v[None].contiguous(),
        g=g[None].float().contiguous(),
        beta=beta[None].contiguous(),
        scale=k.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=plan.cu_seqlens,
        chunk_indices=plan.chunk_indices,
        chunk_size=CHUNK,
    )
    return o[0].to(qn.dtype)  # as the public path: its output in the normalised q's dtype


def gated_delta_rule(q, k, v, g, beta, batch: Batch, impl: str = "auto", qk_normed: bool = False) -> torch.Tensor:
    """Packed q/k (T, hk, dk), v (T, h, dv), g/beta (T, h) -> (T, h, dv), every prompt from a zero state. hk divides
    h: value head i reads key head i // (h // hk) (fla's GVA; the torch form repeats q and k to h heads).
    qk_normed (fla path only): q and k are L2-normed already."""
    hk, h = k.shape[1], v.shape[1]
    if q.shape[1] != hk or h % hk:
        raise ValueError(f"q and k need the same heads, dividing v's {h}: got {q.shape[1]} and {hk}")
    if resolve(impl, v) == "fla":
        return _fla(q, k, v, g, beta, fla_plan(batch), qk_normed).to(v.dtype)
    if qk_normed:
        raise ValueError("qk_normed is for the fla path; the torch form normalises q and k itself")
    if hk != h:
        q, k = q.repeat_interleave(h // hk, dim=1), k.repeat_interleave(h // hk, dim=1)
    if len(batch.lens) * batch.max_len > 2 * batch.num_tokens:
        # the padded view would be mostly padding (one long prompt among short ones: 4096 + 100 x 40 tokens pads to
        # 101 x 4096): each prompt alone instead, the same chunks and arithmetic per prompt
        outs, start = [], 0
        for n in batch.lens:
            qs, ks, vs, gs, bs = (t[start : start + n][None] for t in (q, k, v, g, beta))
            outs.append(chunk_gated_delta_rule_torch(qs, ks, vs, gs, bs)[0])
            start += n
        return torch.cat(outs)
    qp, kp, vp, gp, bp = (batch.pad(t) for t in (q, k, v, g, beta))
    o = chunk_gated_delta_rule_torch(qp, kp, vp, gp, bp)
    return batch.unpad(o)
