"""benchmarks/bench_e2e.py's per-piece breakdown for the hybrids' runtimes (engines/triton/qwen3_5.py, engines/triton/
nemotron_h_model.py): each piece of one layer of each kind timed on its own at the call's shapes, times the layers
of that kind, next to one whole forward (e2e_profile.breakdown prints them with their share of it).

Pieces, each the runtime's own call on the first layer of its kind:
  Qwen3.5       per layer: two add_rms_norm (one on the mixer's output, one summing the MoE block's parts as the
                forward hands them on at TP 1), the MoE block (router + route, the routed experts' moe_forward, the
                gated shared expert); per Gated DeltaNet layer its whole mixer and, inside it, in_proj (q|k|v|z|b|a,
                one LoRA-aware GEMM), the causal conv1d, the chunked gated delta rule, the gated RMSNorm and out_proj;
                per full-attention layer its whole mixer and its q|k|v, attention and o.
  Nemotron-H    per layer one add_rms_norm (after a MoE layer at TP 1 the one that sums its parts: moe_parts, the
                block as the forward runs it); per Mamba-2 layer its whole mixer (engines/triton/mamba.py), in_proj and
                out_proj, and what the mixer spends between them (conv1d + SSD scan + gated norm: the mixer less the
                two projections, so that a change inside mamba.py's scan shows here without this file following
                it); per attention layer the mixer, q/k/v (three LoRA-aware GEMMs), attention and o; per dense MLP
                layer the MLP; per MoE layer the block, router + route, Super's fc1/fc2 latent projections, the routed
                experts (moe_forward, in the latent dim on Super) and the shared expert.
The rows "... layer (mixer)", "moe block", the norms and "logprobs" together are one forward's work; their sum is
printed beside "whole forward" (the difference is what runs between pieces: embedding, the margins' minimum).
"""

from __future__ import annotations

import torch

BETWEEN = "  conv1d + SSD scan + gated norm (the rest)"
WARM, REPS = dict(warmup=25, rep=100, return_mode="median"), dict(warmup=3, rep=20, return_mode="median")


def hybrid_breakdown(rt, prompts, adapter: str, do_bench) -> tuple[dict, dict]:
    """-> ({(piece, "base"|"lora"): ms x count}, {piece: count}) for the runtime's Qwen3.5 or Nemotron-H model."""
    from lpdiff.engines.triton.batch import Batch

    pieces_of = qwen35_pieces if hasattr(rt.model, "linear_attention") else nemotron_pieces
    rows: dict = {}
    counts: dict = {}
    for slot in (-1, rt.slot(adapter)):
        tag = "lora" if slot >= 0 else "base"
        b = Batch.build(prompts, [slot] * len(prompts), rt.cfg, rt.dtype, rt.device)
        x = torch.randn(b.num_tokens, rt.cfg.hidden_size, dtype=rt.dtype, device=rt.device)
        for piece, (count, fn) in pieces_of(rt, b, x).items():
            rows[(piece, tag)] = do_bench(fn, **WARM) * count
            counts[piece] = count
            if piece == "  mamba out_proj lora_linear":  # what the mixer spends between its two projections
                mixer, proj = rows[("Mamba-2 layer (mixer)", tag)], rows[("  mamba in_proj lora_linear", tag)]
                rows[(BETWEEN, tag)], counts[BETWEEN] = mixer - proj - rows[(piece, tag)], count
        rows[("logprobs", tag)] = do_bench(lambda b=b, x=x: logprobs(rt, b, x), **REPS)
        counts["logprobs"] = 1
        parts = [p for p in counts if p.endswith("(mixer)") or p.startswith(("add_rms_norm", "moe block", "logprobs"))]
        rows[("sum of mixers, MoE blocks, norms, logprobs", tag)] = sum(rows[(p, tag)] for p in parts)
        rows[("whole forward", tag)] = do_bench(lambda b=b: rt.model.forward(b), **REPS)
    return rows, counts


def logprobs(rt, b, x: torch.Tensor) -> torch.Tensor:
    """The call's log-softmax over the vocabulary at each prompt position (the runtime's own chunked kernel)."""
    from lpdiff.engines.logprobs import chunked_logprobs

    rows = b.rows
    return chunked_logprobs(x[rows], rt.weights.lm_head, b.input_ids[rows + 1], 0, rt.logit_chunk, fused=True)[0]


def _first(kinds, kind) -> int | None:
    return next((i for i, k in enumerate(kinds) if k == kind), None)


def qwen35_pieces(rt, b, x: torch.Tensor) -> dict:
    """piece -> (layers that run it, fn) for a Qwen3.5 runtime (engines/triton/qwen3_5.Qwen35Model). Each kind's
    pieces are made by a function of their own: a closure shares its variables with the others of its scope."""
    from lpdiff.engines.triton.moe import experts, route

    m, cfg, T = rt.model, rt.cfg, b.num_tokens
    kinds, L = cfg.layer_types, cfg.num_layers
    lw, ll = _qwen35_layer(m, 0)
    mw, moe_lora = lw.moe, (ll.moe if ll is not None else None)
    ids, wts, _ = route(x, mw, cfg, m.impl)
    # the MoE block's output as the forward hands it on: at TP 1 its parts, summed by the next norm (moe())
    moe_out = m.moe(x, mw, ll, b, torch.full((T,), float("inf"), device=x.device))[0]
    out = {
        "add_rms_norm (mixer output)": (L, lambda: m._norm(x, x, lw.post_norm)),
        "add_rms_norm (MoE block output)": (L, lambda: m._norm(x, moe_out, lw.input_norm)),
        "moe block": (L, lambda: m.moe(x, mw, ll, b, torch.full((T,), float("inf"), device=x.device))),
        "  router+route": (L, lambda: route(x, mw, cfg, m.impl)),
        "  moe_forward (routed experts)": (
            L,
            lambda: experts(x, ids, wts, mw, cfg, moe_lora, b.token_adapter, m.lora_impl, m.moe_backend),
        ),
        "  shared expert (gated)": (L, lambda: m.shared(x, mw, ll, b)),
    }
    if (i := _first(kinds, "linear_attention")) is not None:
        out |= _gdn_pieces(m, i, kinds.count("linear_attention"), b, x)
    if (i := _first(kinds, "full_attention")) is not None:
        out |= _qwen35_attention_pieces(m, i, kinds.count("full_attention"), b, x)
    return out


def _qwen35_layer(m, i: int):
    return m.w.layers[i], (m.lora.layers[i] if m.lora is not None else None)


def _gdn_pieces(m, i: int, n: int, b, x: torch.Tensor) -> dict:
    from lpdiff.engines.triton import gdn
    from lpdiff.kernels import gated_norm

    cfg, T = m.cfg, b.num_tokens
    lw, ll = _qwen35_layer(m, i)
    trace: dict = {}
    m.linear_attention(x, lw, ll, b, trace)  # each sub-step's inputs, as the mixer made them
    q, k, v = trace["conv1d"]
    r = m.lin_v // m.lin_k  # the trace repeats q and k to the value heads (as transformers does); the forward does not
    q, k = q[:, ::r].contiguous(), k[:, ::r].contiguous()
    g, beta = trace["gate"]
    conv, _, _, gnorm = lw.linear_parts()
    z = trace["in_proj_z"].reshape(T, m.lin_v, cfg.lin_v_dim)
    return {
        "Gated DeltaNet layer (mixer)": (n, lambda: m.linear_attention(x, lw, ll, b)),
        "  gdn in_proj lora_linear": (n, lambda: m.linear(x, lw.proj_in, ll and ll.proj_in, b)),
        "  gdn causal conv1d": (
            n,
            lambda: gdn.causal_conv1d_parts(
                trace["in_proj_qkv"], conv, b, [m.lin_k * cfg.lin_k_dim] * 2 + [m.lin_v * cfg.lin_v_dim], m.gdn_impl
            ),
        ),
        "  gdn gated delta rule": (n, lambda: gdn.gated_delta_rule(q, k, v, g, beta, b, m.gdn_impl)),
        "  gdn gated rms_norm": (n, lambda: gated_norm.norm_then_gate(trace["delta_rule"], z, gnorm, cfg.rms_norm_eps)),
        "  gdn out_proj lora_linear": (n, lambda: m.linear(trace["gated_norm"], lw.proj_out, ll and ll.proj_out, b)),
    }


def _qwen35_attention_pieces(m, i: int, n: int, b, x: torch.Tensor) -> dict:
    from lpdiff.engines.triton.attention import attention

    lw, ll = _qwen35_layer(m, i)
    qa, ka, va, o, d = _attention_inputs(m, b, x)
    return {
        "attention layer (mixer)": (n, lambda: m.full_attention(x, lw, ll, b)),
        "  q(+gate)|k|v lora_linear": (n, lambda: m.linear(x, lw.proj_in, ll and ll.proj_in, b)),
        "  attention": (n, lambda: attention(qa, ka, va, b, d**-0.5, None, None, m.attention_impl)),
        "  o lora_linear": (n, lambda: m.linear(o, lw.proj_out, ll and ll.proj_out, b)),
    }


def _attention_inputs(m, b, x: torch.Tensor) -> tuple:
    """Random q (T, heads, d), k, v (T, kv_heads, d) and the o projection's input (T, heads d), of this rank."""
    T, d = b.num_tokens, m.cfg.head_dim
    qa, ka, va = (torch.randn(T, h, d, dtype=x.dtype, device=x.device) for h in (m.heads, m.kv_heads, m.kv_heads))
    return qa, ka, va, torch.randn(T, m.heads * d, dtype=x.dtype, device=x.device), d


def nemotron_pieces(rt, b, x: torch.Tensor) -> dict:
    """piece -> (layers that run it, fn) for a Nemotron-H runtime (engines/triton/nemotron_h_model.NemotronHModel),
    each kind's pieces made in a scope of their own (see qwen35_pieces)."""
    m, kinds = rt.model, rt.cfg.kinds
    lay0 = m.w.layers[0]
    folded = kinds.count("E") if m.fuse_moe_tail else 0  # the norms after a MoE layer sum its parts (moe_parts)
    out = {"add_rms_norm (mixer output)": (len(kinds) - folded, lambda: m._norm(x, x, lay0.norm))}
    for kind, make in (("M", _mamba_pieces), ("*", _nemotron_attention_pieces), ("-", _mlp_pieces), ("E", _moe_pieces)):
        if (i := _first(kinds, kind)) is not None:
            out |= make(m, m.w.layers[i], kinds.count(kind), b, x)
    return out


def _mamba_pieces(m, lay, n: int, b, x: torch.Tensor) -> dict:
    from lpdiff.engines.triton.mamba import mamba_mixer

    y = torch.randn(b.num_tokens, lay.mods["out_proj"].w.shape[1], dtype=x.dtype, device=x.device)
    return {
        "Mamba-2 layer (mixer)": (n, lambda: mamba_mixer(m, x, lay, b)),
        "  mamba in_proj lora_linear": (n, lambda: m.linear(x, lay.mods["in_proj"], b)),
        "  mamba out_proj lora_linear": (n, lambda: m.linear(y, lay.mods["out_proj"], b)),
    }


def _nemotron_attention_pieces(m, lay, n: int, b, x: torch.Tensor) -> dict:
    from lpdiff.engines.triton.attention import attention

    qa, ka, va, o, d = _attention_inputs(m, b, x)
    return {
        "attention layer (mixer)": (n, lambda: m.attend(x, lay, b)),
        "  q, k, v lora_linear": (n, lambda: [m.linear(x, lay.mods[p], b) for p in ("q_proj", "k_proj", "v_proj")]),
        "  attention": (n, lambda: attention(qa, ka, va, b, d**-0.5, None, None, m.attention_impl)),
        "  o lora_linear": (n, lambda: m.linear(o, lay.mods["o_proj"], b)),
    }


def _mlp_pieces(m, lay, n: int, b, x: torch.Tensor) -> dict:
    return {"mlp layer (mixer)": (n, lambda: m.mlp(x, lay.mods["up_proj"], lay.mods["down_proj"], b))}


def _moe_pieces(m, lay, n: int, b, x: torch.Tensor) -> dict:
    mods = lay.mods
    ids, wts, _ = m.route(x, lay)
    latent = "fc1_latent_proj" in mods  # Super: the routed experts run in the latent dim between two projections
    xl = m.linear(x, mods["fc1_latent_proj"], b) if latent else x
    block = m.moe_parts if m.fuse_moe_tail else m.moe  # as the forward runs it (nemotron_h_model.forward)
    out = {
        "moe block": (n, lambda: block(x, lay, b, None)),
        "  router+route": (n, lambda: m.route(x, lay)),
        "  moe_forward (routed experts)": (n, lambda: m.routed(xl, ids, wts, lay, b)),
        "  shared expert": (n, lambda: m.shared(x, lay, b)),
    }
    if m.fuse_moe_tail:
        parts = m.moe_parts(x, lay, b, None)
        out["add_rms_norm (MoE block output)"] = (n, lambda: m._norm(x, parts, lay.norm))
    if latent:
        yl = torch.randn_like(xl)
        out["  fc1_latent_proj lora_linear"] = (n, lambda: m.linear(x, mods["fc1_latent_proj"], b))
        out["  fc2_latent_proj lora_linear"] = (n, lambda: m.linear(yl, mods["fc2_latent_proj"], b))
    return out
