"""Qwen3.5-MoE (Qwen3.5-35B-A3B's text model; the Hub checkpoint names it model.language_model.*), built whole by
this module (archs.HYBRIDS): layers of Gated DeltaNet linear attention (gdn.py) or gated full attention, each
followed by a sparse MoE block with a sigmoid-gated shared expert.

- Gated DeltaNet: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a as one GEMM (LoRA per part), causal depthwise
  conv1d + silu on q|k|v, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated delta rule over each
  prompt from a zero state, the gated RMSNorm with z, out_proj.
- Full attention: q_proj is twice as wide (per head: query then an output gate), q/k RMSNorm, rope on the first
  partial_rotary_factor of each head, GQA attention (attention.py), output * sigmoid(gate), o_proj.
- MoE: the router and routed experts of the shared path (moe.py; softmax over all experts, top-k renormalised), plus
  the shared expert scaled by sigmoid(shared_expert_gate(x)).
- Every RMSNorm but the gated one multiplies by (1 + weight) in fp32 (Qwen3_5MoeRMSNorm): the weight is stored as
  1 + w in fp32 once and the norms run in the fp32-weight mode of norm.py.

Tensor parallelism: attention and linear-attention heads, the shared expert's and the experts' widths are split;
conv channels and the recurrent state follow their heads; o_proj, out_proj and the down projections are
row-parallel and one all-reduce per sublayer sums them. LoRA stacking is in qwen3_5_lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lpdiff.engines.triton import gdn
from lpdiff.engines.triton.archs import Built
from lpdiff.engines.triton.attention import attention
from lpdiff.engines.triton.batch import Batch
from lpdiff.engines.triton.config import rope_from_hf
from lpdiff.engines.triton.gdn_conv import conv_silu_l2norm
from lpdiff.engines.triton.moe import experts, route
from lpdiff.engines.triton.norm import add_rms_norm, moe_delta
from lpdiff.engines.triton.qwen3_5_kernels import gdn_gates, sigmoid_gate, silu_mul
from lpdiff.engines.triton.qwen3_5_lora import Linear, LinearLora, layer_linears, load_linear, stack_qwen35
from lpdiff.engines.triton.rope import norm_partial_rope_qk
from lpdiff.engines.triton.shard import Shard, tp_fix
from lpdiff.harness.spec.errors import InputError
from lpdiff.kernels import faults, gated_norm, lora_linear

Tensor = torch.Tensor
# True: the GDN's conv, SiLU and q/k L2 norm as one pass on the fla path (gdn_conv.py); False: fla's conv per channel
# group, torch's SiLU and fla's l2norm_fwd (same bits: the gpu1 test compares them). The chain is the default: in the
# replayed full-depth forward on an H200 the fused pass took 4.56 ms a call (30 x 152 us) where the chain's kernels
# took 3.15 ms (conv 1.47 + SiLU 1.09 + l2norm 0.59; benchmarks/results/e2e.md); the pass needs its tiles tuned first
FUSED_GDN_INPUT = False


@dataclass(slots=True)
class Qwen35Config:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_inv_freq: Tensor  # (rotary_dim // 2,) float32: rope turns the first rotary_dim dims of each head
    rope_attention_scaling: float
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # what moe.route / moe.experts read
    activation: str = "silu"
    router: str = "softmax_topk"
    norm_topk_prob: bool = True  # Qwen3_5MoeTopKRouter always renormalises the top-k
    router_bias: bool = False
    expert_bias: bool = False

    @property
    def rotary_dim(self) -> int:
        return 2 * self.rope_inv_freq.shape[0]


def config_from_hf(hf) -> Qwen35Config:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    if hf.hidden_act != "silu":
        raise ValueError(f"Qwen3.5-MoE with hidden_act={hf.hidden_act!r} is not supported (expected 'silu')")
    if getattr(hf, "attention_bias", False):
        raise ValueError("Qwen3.5-MoE with attention_bias is not supported by the triton engine; use engine 'hf'")
    inv_freq, scaling = rope_from_hf(Qwen3_5MoeTextRotaryEmbedding, hf)
    n = hf.num_hidden_layers
    return Qwen35Config(
        arch="qwen3_5_moe",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=n,
        layer_types=tuple(hf.layer_types[:n]),
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rope_inv_freq=inv_freq,
        rope_attention_scaling=scaling,
        lin_k_heads=hf.linear_num_key_heads,
        lin_v_heads=hf.linear_num_value_heads,
        lin_k_dim=hf.linear_key_head_dim,
        lin_v_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_width=hf.moe_intermediate_size,
        shared_width=hf.shared_expert_intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


@dataclass(slots=True)
class MoeWeights:
    """One layer's MoE block; the first six fields are what moe.route / moe.experts read."""

    router: Tensor  # (E, H), replicated
    router_bias: None
    w_gate_up: Tensor  # (E, 2 I_loc, H) gate then up
    w_down: Tensor  # (E, H, I_loc)
    b_gate_up: None
    b_down: None
    shared_gate_up: Linear  # (2 S_loc, H): gate rows then up rows
    shared_down: Linear  # (H, S_loc)
    shared_gate: Tensor  # (1, H), replicated


@dataclass(slots=True)
class LayerWeights:
    kind: str
    input_norm: Tensor  # (H,) fp32, 1 + w
    post_norm: Tensor
    proj_in: Linear  # linear: qkv|z|b|a (local heads); full: q(+gate)|k|v
    proj_out: Linear  # out_proj / o_proj, input columns of the local heads
    moe: MoeWeights
    conv: Tensor | None = None  # (C_loc, K) linear attention
    A_log: Tensor | None = None  # (v_heads_loc,)
    dt_bias: Tensor | None = None
    gnorm: Tensor | None = None  # (dv,) gated RMSNorm weight (plain, not 1 + w)
    q_norm: Tensor | None = None  # (d,) fp32, 1 + w
    k_norm: Tensor | None = None

    def linear_parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """conv, A_log, dt_bias, gnorm of a linear-attention layer."""
        conv, a_log, dt_bias, gnorm = self.conv, self.A_log, self.dt_bias, self.gnorm
        if conv is None or a_log is None or dt_bias is None or gnorm is None:
            raise ValueError(f"a {self.kind} layer has no linear-attention weights")
        return conv, a_log, dt_bias, gnorm

    def qk_norms(self) -> tuple[Tensor, Tensor]:
        """q_norm, k_norm of a full-attention layer."""
        if self.q_norm is None or self.k_norm is None:
            raise ValueError(f"a {self.kind} layer has no q/k norms")
        return self.q_norm, self.k_norm


@dataclass(slots=True)
class Qwen35Weights:
    embed: Tensor
    norm: Tensor  # fp32, 1 + w
    lm_head: Tensor
    layers: list[LayerWeights]

    def nbytes(self) -> int:
        seen, total = set(), 0
        ts: list[Tensor | None] = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            m = lw.moe
            ts += [
                lw.input_norm,
                lw.post_norm,
                lw.proj_in.w,
                lw.proj_out.w,
                lw.conv,
                lw.A_log,
                lw.dt_bias,
                lw.gnorm,
                lw.q_norm,
                lw.k_norm,
                m.router,
                m.w_gate_up,
                m.w_down,
                m.shared_gate_up.w,
                m.shared_down.w,
                m.shared_gate,
            ]
        for t in ts:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


class Qwen35Model:
    def __init__(
        self,
        cfg: Qwen35Config,
        weights: Qwen35Weights,
        lora,
        shard: Shard,
        all_reduce,
        impl: str,
        attention_impl: str,
        gdn_impl: str = "auto",
        moe_backend: str = "triton",
    ):
        self.cfg, self.w, self.lora, self.shard, self.all_reduce = cfg, weights, lora, shard, all_reduce
        self.impl, self.attention_impl, self.gdn_impl, self.moe_backend = impl, attention_impl, gdn_impl, moe_backend
        self.lora_impl = impl if lora is None or int(lora.ranks.max()) <= _max_rank() else "torch"
        self.capture: dict | None = None
        qh, kvh = shard.heads(cfg.num_heads, cfg.num_kv_heads)
        self.heads, self.kv_heads = len(qh), len(kvh)
        self.lin_k, self.lin_v = cfg.lin_k_heads // shard.size, cfg.lin_v_heads // shard.size

    def _norm(self, x, delta, weight):
        """delta: a sublayer's output (T, H), or the MoE block's parts (routed, shared, gate) when moe() fuses its
        tail into this norm."""
        if isinstance(delta, tuple):
            routed, shared, gate = delta
            return add_rms_norm(x, routed, weight, self.cfg.rms_norm_eps, True, self.impl, None, shared, gate)
        return add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps, True, self.impl)

    def linear(self, x: Tensor, lin: Linear, ll: LinearLora | None, batch: Batch) -> Tensor:
        if ll is None or batch.token_adapter is None:
            return lora_linear(x, lin.w, None, impl=self.impl)
        uniform = batch.uniform_slot
        mask = batch.slot_mask(ll.a.shape[0], x.dtype) if uniform is None else None
        return lora_linear(
            x,
            lin.w,
            None,
            ll.a,
            ll.b,
            self.lora.scaling,
            lin.offsets,
            batch.token_adapter,
            impl=self.lora_impl,
            b_packed=ll.b_packed,
            slot_mask=mask,
            uniform_slot=uniform,
        )

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        x = self.w.embed[batch.input_ids]
        margin = torch.full((batch.num_tokens,), float("inf"), device=x.device)
        delta = None
        for i, lw in enumerate(self.w.layers):
            ll = self.lora.layers[i] if self.lora is not None else None
            h, x = self._norm(x, delta, lw.input_norm)
            delta = self.mix(h, lw, ll, batch)
            h, x = self._norm(x, delta, lw.post_norm)
            delta, margin = self.moe(h, lw.moe, ll, batch, margin)
            if self.capture is not None:
                self.capture[i] = x + (moe_delta(*delta) if isinstance(delta, tuple) else delta)
        return self._norm(x, delta, self.w.norm)[0], margin

    def mix(self, h: Tensor, lw: LayerWeights, ll, batch: Batch) -> Tensor:
        """The layer's token mixer, all-reduced: (T, H) -> (T, H)."""
        if lw.kind == "linear_attention":
            return self.linear_attention(h, lw, ll, batch)
        return self.full_attention(h, lw, ll, batch)

    def linear_attention(self, h: Tensor, lw: LayerWeights, ll, batch: Batch, trace: dict | None = None) -> Tensor:
        """``trace`` (lpdiff bisect, TP 1): filled with each sub-step's output as (T, width), named as
        engines/hf_steps.py names transformers'."""
        cfg, T = self.cfg, h.shape[0]
        tracing, trace = trace is not None, {} if trace is None else trace  # untraced: stores of tensors made anyway
        nk, nv, dk, dv = self.lin_k, self.lin_v, cfg.lin_k_dim, cfg.lin_v_dim
        if faults.on("linear_attention_lora_dropped"):
            ll = None
        proj = self.linear(h, lw.proj_in, ll and ll.proj_in, batch)
        qkv, z, b, a = proj.split([2 * nk * dk + nv * dv, nv * dv, nv, nv], dim=-1)
        trace.update(in_proj_qkv=qkv, in_proj_z=z, in_proj_b=b, in_proj_a=a)
        conv, A_log, dt_bias, gnorm = lw.linear_parts()
        # conv_across_prompts: the whole packed batch as one sequence, on whichever conv path runs
        conv_batch = _one_prompt(batch) if faults.on("conv_across_prompts") else batch
        fused = FUSED_GDN_INPUT and not tracing and gdn.resolve(self.gdn_impl, qkv) == "fla"
        if fused:  # conv, SiLU and fla's q/k L2 norm in one pass (the trace wants the conv's output itself)
            q, k, v = conv_silu_l2norm(qkv, conv, conv_batch.positions, nk, dk, nv, dv)
        else:
            q, k, v = gdn.causal_conv1d_parts(qkv, conv, conv_batch, [nk * dk, nk * dk, nv * dv], self.gdn_impl)
            q, k, v = q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv)
        g, beta = gdn_gates(a, b, A_log, dt_bias, self.impl)
        # q and k stay at their nk heads: the delta rule maps value heads to key heads itself (gdn.gated_delta_rule)
        if tracing:  # (T, h, d) each, q and k repeated to v's heads as transformers passes them
            r = nv // nk
            trace["conv1d"] = (q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1), v) if r > 1 else (q, k, v)
        trace["gate"] = (g, beta)
        if faults.on("state_not_reset"):
            o = gdn.gated_delta_rule(q, k, v, g, beta, _one_prompt(batch), self.gdn_impl, fused)
        else:
            o = gdn.gated_delta_rule(q, k, v, g, beta, batch, self.gdn_impl, fused)
        trace["delta_rule"] = o
        o = gated_norm.norm_then_gate(o, z.reshape(T, nv, dv), gnorm, cfg.rms_norm_eps).reshape(T, nv * dv)
        trace["gated_norm"] = o
        trace["out_proj"] = out = self.linear(o, lw.proj_out, ll and ll.proj_out, batch)
        return self.all_reduce(out)

    def full_attention(self, h: Tensor, lw: LayerWeights, ll, batch: Batch) -> Tensor:
        cfg, T, d = self.cfg, h.shape[0], self.cfg.head_dim
        qkv = self.linear(h, lw.proj_in, ll and ll.proj_in, batch)
        qg, k, v = qkv.split([self.heads * 2 * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, gate = qg.view(T, self.heads, 2 * d).chunk(2, dim=-1)
        q_norm, k_norm = lw.qk_norms()
        k = k.view(T, self.kv_heads, d)
        q, k = norm_partial_rope_qk(
            q, k, q_norm, k_norm, cfg.rms_norm_eps, batch.cos, batch.sin, cfg.rotary_dim, self.impl
        )
        o = attention(q, k, v.view(T, self.kv_heads, d), batch, d**-0.5, None, None, self.attention_impl)
        o = sigmoid_gate(o, gate, self.impl)
        return self.all_reduce(self.linear(o, lw.proj_out, ll and ll.proj_out, batch))

    def moe(self, h: Tensor, mw: MoeWeights, ll, batch: Batch, margin: Tensor):
        """Routed experts + sigmoid-gated shared expert -> (the block's output, the running margin updated). At TP 1
        the output is its parts (routed (T, K, H) unsummed where the experts can skip the sum, else (T, H); the shared
        expert's (T, H) or None; its gate logit (T, 1) or None) for the next add_rms_norm to combine in one pass
        (norm.moe_delta's roundings); under TP the all-reduced (T, H) sum, one all-reduce of (T, H) per block."""
        ids, weights, margin = route(h, mw, self.cfg, self.impl, min_into=margin)
        fuse = self.shard.size == 1
        lora = (ll.moe if ll is not None else None, batch.token_adapter, self.lora_impl, self.moe_backend)
        out = experts(h, ids, weights, mw, self.cfg, *lora, sum_topk=not fuse)
        if fuse:
            return (out, *self.shared_parts(h, mw, ll, batch)), margin
        return self.all_reduce(out + self.shared(h, mw, ll, batch)), margin

    def shared_parts(self, h: Tensor, mw: MoeWeights, ll, batch: Batch) -> tuple[Tensor | None, Tensor | None]:
        """The shared expert's output (T, H) and its gate logit (T, 1), this rank's partials; (None, None) while
        the shared_expert_dropped fault is on."""
        if faults.on("shared_expert_dropped"):
            return None, None
        gate_up = self.linear(h, mw.shared_gate_up, ll and ll.shared_gate_up, batch)
        s = self.linear(silu_mul(gate_up, self.impl), mw.shared_down, ll and ll.shared_down, batch)
        return s, F.linear(h, mw.shared_gate)

    def shared(self, h: Tensor, mw: MoeWeights, ll, batch: Batch) -> Tensor:
        """The shared expert scaled by its sigmoid gate: this rank's partial (T, H)."""
        s, gate = self.shared_parts(h, mw, ll, batch)
        if s is None or gate is None:
            return torch.zeros_like(h)
        return torch.sigmoid(gate) * s

    @torch.inference_mode()
    def capture_modules(self, batch: Batch, inputs: dict, steps: tuple[int, ...] = ()) -> dict:
        """capture.py's module re-runs on another engine's inputs (capture.is_input), with the adapters and without
        ("_base"): each layer's token mixer on its input point ("linear_attention_in" or "attention_in", the
        output named alike), the routed experts on the reference's routing, the gated shared expert, and this
        model's own routing of the experts' input. All-reduced: full (T, H) outputs on every rank. A Gated DeltaNet
        layer in ``steps`` also reports its sub-steps (capture.put_steps; TP 1)."""
        from lpdiff.engines.triton.capture import put_steps

        cfg, dev, dtype = self.cfg, self.w.embed.device, self.w.embed.dtype
        cap: dict = {}
        for i, lw in enumerate(self.w.layers):
            ll = self.lora.layers[i] if self.lora is not None else None
            for point in ("linear_attention", "attention"):
                if (i, f"{point}_in") in inputs:
                    h = inputs[i, f"{point}_in"].to(dev, dtype)
                    if point == "linear_attention" and i in steps:
                        for suffix, lora in (("", ll), ("_base", None)):
                            trace: dict = {}
                            cap[i, point + suffix] = self.linear_attention(h, lw, lora, batch, trace)
                            put_steps(cap, i, point, trace, suffix)
                        continue
                    cap[i, point] = self.mix(h, lw, ll, batch)
                    cap[i, f"{point}_base"] = self.mix(h, lw, None, batch)
            if (i, "experts_in") in inputs:
                x = inputs[i, "experts_in"].to(dev, dtype)
                ids, w32 = inputs[i, "router_ids"].to(dev), inputs[i, "router_weights"].to(dev).float()
                cap[i, "router_ids"], cap[i, "router_weights"], _ = route(x, lw.moe, cfg, self.impl)
                moe_lora = ll.moe if ll is not None else None
                cap[i, "experts"] = self.all_reduce(
                    experts(x, ids, w32, lw.moe, cfg, moe_lora, batch.token_adapter, self.lora_impl, self.moe_backend)
                )
                cap[i, "experts_base"] = self.all_reduce(
                    experts(x, ids, w32, lw.moe, cfg, None, None, self.lora_impl, self.moe_backend)
                )
            if (i, "shared_expert_in") in inputs:
                x = inputs[i, "shared_expert_in"].to(dev, dtype)
                cap[i, "shared_expert"] = self.all_reduce(self.shared(x, lw.moe, ll, batch))
                cap[i, "shared_expert_base"] = self.all_reduce(self.shared(x, lw.moe, None, batch))
        return cap


def _one_prompt(batch: Batch) -> Batch:
    """The batch seen as one prompt (the faults that let state or conv windows run across prompt boundaries), made
    once per batch from its host token count (kept in batch.plans: the first forward, before any CUDA graph
    capture, builds it, so a captured forward copies nothing). Its token ids are placeholders: the conv and the
    delta rule read only its lengths and index maps."""
    one = batch.plans.get("one_prompt")
    if one is None:
        dev = batch.input_ids.device
        one = batch.plans["one_prompt"] = Batch.build([[0] * batch.num_tokens], [-1], _RopeStub(), batch.cos.dtype, dev)
    return one


class _RopeStub:
    """Batch.build's cfg for _one_prompt: only its index maps are used, so rope is one frequency of zeros."""

    rope_inv_freq = torch.zeros(1)
    rope_attention_scaling = 1.0


def _max_rank() -> int:
    from lpdiff.kernels import MAX_RANK

    return MAX_RANK


def load(cfg: Qwen35Config, source, shard: Shard, dtype, device) -> Qwen35Weights:
    # the Hub checkpoint (Qwen3_5MoeForConditionalGeneration) keeps the text model under model.language_model.
    root = "model.language_model." if source.has("model.language_model.embed_tokens.weight") else "model."

    def take(name: str, want=dtype) -> Tensor:
        key = root + name.removeprefix("model.") if name.startswith("model.") else name
        return source.take(key).to(device=device, dtype=want).contiguous()

    def one_plus(name: str) -> Tensor:  # Qwen3_5MoeRMSNorm multiplies by (1 + w) in fp32
        return 1.0 + take(name, torch.float32)

    split = shard.split
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        kind = cfg.layer_types[i]
        if kind not in ("linear_attention", "full_attention"):
            raise ValueError(
                f"layer {i} of this Qwen3.5 config has type {kind!r}; the triton engine runs "
                "linear_attention and full_attention layers"
            )
        lin = {name: load_linear(spec, take, p) for name, spec in layer_linears(cfg, kind, shard).items()}
        m = p + "mlp."
        moe = MoeWeights(
            router=take(m + "gate.weight"),
            router_bias=None,
            w_gate_up=shard.split_gate_up(take(m + "experts.gate_up_proj"), 1).contiguous(),
            w_down=split(take(m + "experts.down_proj"), 2).contiguous(),
            b_gate_up=None,
            b_down=None,
            shared_gate_up=lin["shared_gate_up"],
            shared_down=lin["shared_down"],
            shared_gate=take(m + "shared_expert_gate.weight"),
        )
        lw = LayerWeights(
            kind=kind,
            input_norm=one_plus(p + "input_layernorm.weight"),
            post_norm=one_plus(p + "post_attention_layernorm.weight"),
            proj_in=lin["proj_in"],
            proj_out=lin["proj_out"],
            moe=moe,
        )
        if kind == "linear_attention":
            a = p + "linear_attn."
            conv = take(a + "conv1d.weight")[:, 0]  # (C, 1, K) -> (C, K); channels are q|k|v like in_proj_qkv
            lw.conv = layer_linears(cfg, kind, shard)["proj_in"].parts[0][1](conv, 0).contiguous()
            lw.A_log, lw.dt_bias = split(take(a + "A_log"), 0), split(take(a + "dt_bias"), 0)
            lw.gnorm = take(a + "norm.weight")
        else:
            a = p + "self_attn."
            lw.q_norm, lw.k_norm = one_plus(a + "q_norm.weight"), one_plus(a + "k_norm.weight")
        layers.append(lw)
    embed = take("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else take("lm_head.weight")
    return Qwen35Weights(embed=embed, norm=one_plus("model.norm.weight"), lm_head=lm_head, layers=layers)


def build(hf, source, adapters: dict, shard: Shard, dtype, device, all_reduce, options) -> Built:
    """archs.HYBRIDS' hook: the whole model of one tensor-parallel rank."""
    cfg = config_from_hf(hf)
    for n, what in ((cfg.lin_k_heads, "linear-attention key heads"), (cfg.lin_v_heads, "linear-attention value heads")):
        if n % shard.size:  # checked before loading: shard.split would cut widths across heads
            raise InputError(f"{n} {what} do not split over tp={shard.size}; {tp_fix(n)}")
    weights = load(cfg, source, shard, dtype, device)
    lora = stack_qwen35(cfg, weights, adapters, shard, dtype, device)
    model = Qwen35Model(
        cfg,
        weights,
        lora,
        shard,
        all_reduce,
        options.impl,
        options.attention,
        getattr(options, "gdn", "auto"),
        options.moe_backend,
    )
    return Built(cfg=cfg, weights=weights, lora=lora, model=model)
