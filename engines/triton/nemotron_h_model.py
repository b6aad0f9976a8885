"""Nemotron-H's forward over a packed batch: embed -> [RMSNorm -> mixer -> +res] x N -> RMSNorm, the mixer of each
layer as its kind says (nemotron_h.py): Mamba-2 (mamba.py), attention without rotary, the routed + shared relu² MoE,
or a dense relu² MLP. The residual add is fused into the next RMSNorm (norm.add_rms_norm). LoRA runs on every
projection that holds stacked factors (kernels.lora_linear per slot, the routed experts through kernels.moe_forward).
Each mixer's output is this rank's partial sum under TP, all-reduced before the residual add.

At TP 1 a MoE layer hands the next norm its parts (moe_parts): the routed experts' weighted top-k outputs unsummed
(T, K, H) where moe_forward can skip the sum, and the shared expert's (T, H); the norm sums the top-k, adds the
shared expert and the residual in one pass with the unfused ops' roundings (norm.moe_delta). On an H200 (Nano,
bf16, 8 x 512 tokens; benchmarks/results/e2e.md) the separate top-k reduction and the routed + shared add took
1.67 + ~0.35 ms of a 65.7 ms call. Super's latent MoE sums its top-k in the latent dim before fc2_latent_proj,
so there only the routed + shared add folds. Under TP the partials are all-reduced as one (T, H) sum first.

The router follows transformers' NemotronHTopkRouter: fp32 logits (kernels.fp32_sums_gemm), sigmoid scores, the
correction bias added for the choice only, top-``topk_group`` groups by the sum of their two best biased scores,
top-k inside them, weights the unbiased scores of the chosen experts (renormalised with +1e-20 when norm_topk_prob)
times routed_scaling (moe.route_sigmoid: one Triton kernel after the GEMM on a GPU, the torch reference on CPU and
for grouped picks).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lpdiff.engines.triton.attention import attention
from lpdiff.engines.triton.batch import Batch
from lpdiff.engines.triton.lora import session_lora_impl
from lpdiff.engines.triton.mamba import mamba_mixer
from lpdiff.engines.triton.moe import route_sigmoid
from lpdiff.engines.triton.nemotron_h_weights import HybridLora, Layer, Linear, NemotronHConfig, Weights
from lpdiff.engines.triton.norm import add_rms_norm, moe_delta
from lpdiff.engines.triton.shard import Shard
from lpdiff.kernels import MoeInputs, faults, lora_linear, moe_forward
from lpdiff.kernels.activation import relu2_
from lpdiff.kernels.fp32_sums_gemm import fp32_sums_gemm


class NemotronHModel:
    def __init__(
        self,
        cfg: NemotronHConfig,
        weights: Weights,
        lora: HybridLora | None,
        shard: Shard,
        all_reduce,
        impl: str = "auto",
        attention_impl: str = "auto",
        moe_backend: str = "triton",
        mamba_scan: str = "auto",
    ):
        self.cfg, self.w, self.lora, self.shard = cfg, weights, lora, shard
        self.mamba_scan = mamba_scan  # the engine's mamba_scan option (mamba.scan_impl)
        self.all_reduce = all_reduce  # sums row-parallel partial outputs over the TP group (identity at TP 1)
        self.impl, self.attention_impl, self.moe_backend = impl, attention_impl, moe_backend
        self.lora_impl = session_lora_impl(impl, lora)
        self.capture: dict | None = None  # opt-in (lpdiff bisect): layer index -> that layer's output hidden states
        self.vocab = None  # vocab_lora.VocabLora of the session's adapters (set by the runtime), or None
        qh, kvh = shard.heads(cfg.num_heads, cfg.num_kv_heads) if "*" in cfg.kinds else (range(0), range(0))
        self.heads, self.kv_heads = len(qh), len(kvh)
        # the MoE tail (top-k sum, + shared expert) folded into the next add_rms_norm: TP 1 only, where nothing is
        # all-reduced between the experts and the norm
        self.fuse_moe_tail = shard.size == 1

    def linear(self, x: torch.Tensor, lin: Linear, batch: Batch) -> torch.Tensor:
        if lin.a is None or batch.token_adapter is None or self.lora is None:
            return lora_linear(x, lin.w, lin.bias, impl=self.impl)
        # B packed once per session and the slot mask once per batch: the same operands lora_linear's cublas path
        # would otherwise rebuild on every call (each row still computes every slot's shrink columns, so the
        # arithmetic, and every bit of the output, are what they were)
        return lora_linear(
            x,
            lin.w,
            lin.bias,
            lin.a,
            lin.b,
            self.lora.scaling,
            None,
            batch.token_adapter,
            impl=self.lora_impl,
            b_packed=lin.b_packed,
            slot_mask=batch.slot_mask(lin.a.shape[0], x.dtype),
        )

    def _norm(self, x, delta, weight):
        """delta: a mixer's output (T, H), or a MoE block's parts (routed, shared) when moe_parts folds its tail
        into this norm."""
        routed, shared = delta if isinstance(delta, tuple) else (delta, None)
        return add_rms_norm(x, routed, weight, self.cfg.rms_norm_eps, False, self.impl, None, shared)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> final-normed hidden states (T, H) and each token's smallest routing margin over MoE layers (T,)."""
        x = self.w.embed[batch.input_ids]
        if self.vocab is not None and (d := self.vocab.embed_delta(batch.input_ids, batch.token_adapter)) is not None:
            x = x + d  # embedding LoRA (vocab_lora.py; lm_head LoRA runs in the runtime's log-softmax)
        margin = torch.full((batch.num_tokens,), float("inf"), device=x.device)
        # the last mixer's output (or a MoE block's parts: moe_parts), not yet added to the residual x
        delta: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
        for i, lay in enumerate(self.w.layers):
            h, x = self._norm(x, delta, lay.norm)
            if lay.kind == "E" and self.fuse_moe_tail:
                delta = self.moe_parts(h, lay, batch, margin)
            else:
                delta = self.mixer(h, lay, batch, margin)
            if self.capture is not None:
                self.capture[i] = x + (moe_delta(*delta) if isinstance(delta, tuple) else delta)
        return self._norm(x, delta, self.w.norm)[0], margin

    def mixer(self, h: torch.Tensor, lay: Layer, batch: Batch, margin: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's mixer on its normed input, all-reduced; ``margin`` (T,) is lowered in place by a MoE layer."""
        if lay.kind == "M":
            out = mamba_mixer(self, h, lay, batch)
        elif lay.kind == "*":
            out = self.attend(h, lay, batch)
        elif lay.kind == "-":
            out = self.mlp(h, lay.mods["up_proj"], lay.mods["down_proj"], batch)
        else:
            out = self.moe(h, lay, batch, margin)
        return self.all_reduce(out)

    def attend(self, h: torch.Tensor, lay: Layer, batch: Batch) -> torch.Tensor:
        d, T, m = self.cfg.head_dim, h.shape[0], lay.mods
        q = self.linear(h, m["q_proj"], batch).view(T, self.heads, d)
        k = self.linear(h, m["k_proj"], batch).view(T, self.kv_heads, d)
        v = self.linear(h, m["v_proj"], batch).view(T, self.kv_heads, d)
        o = attention(q, k, v, batch, d**-0.5, None, None, self.attention_impl).reshape(T, self.heads * d)
        return self.linear(o, m["o_proj"], batch)

    def mlp(self, h: torch.Tensor, up: Linear, down: Linear, batch: Batch) -> torch.Tensor:
        """down(relu(up(h))²): the dense layer and the shared expert (non-gated); the square in place, one pass."""
        return self.linear(relu2_(self.linear(h, up, batch), self.impl), down, batch)

    def route(
        self, h: torch.Tensor, lay: Layer, min_into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> top-k ids (T, K), weights (T, K) fp32, margin (T,): the gap between the k-th and (k+1)-th biased score
        over all experts (harness.routing's definition for sigmoid routers). ``min_into`` (T,): the running minimum
        of the layers before, lowered in place and returned as the margin (moe.route_sigmoid)."""
        cfg = self.cfg
        bias = lay.need("router_bias")
        if faults.on("router_bias_rounded"):
            bias = torch.round(bias, decimals=2)
        # fp32 sums of the bf16 products, as transformers' fp32 GEMM forms them: the routing bits depend on it
        logits = fp32_sums_gemm(h, lay.need("router"), self.impl)
        groups = (cfg.n_group, cfg.topk_group)
        return route_sigmoid(
            logits, bias, cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling, groups, self.impl, min_into
        )

    def moe(self, h: torch.Tensor, lay: Layer, batch: Batch, margin: torch.Tensor | None) -> torch.Tensor:
        """The MoE block's output (T, H): this rank's partial."""
        ids, weights, _ = self.route(h, lay, margin)
        return self.experts(h, ids, weights, lay, batch) + self.shared(h, lay, batch)

    def moe_parts(
        self, h: torch.Tensor, lay: Layer, batch: Batch, margin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE block at TP 1 as the next norm's parts: the routed experts' output, (T, K, H) weighted and
        unsummed where moe_forward can skip the sum (impl and backend triton, no latent projection), else (T, H);
        and the shared expert's (T, H). moe() is their sum."""
        ids, weights, _ = self.route(h, lay, margin)
        return self.experts(h, ids, weights, lay, batch, sum_topk=False), self.shared(h, lay, batch)

    def experts(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        lay: Layer,
        batch: Batch,
        use_lora: bool = True,
        sum_topk: bool = True,
    ) -> torch.Tensor:
        """The routed experts (through the latent projections where the model has them), this rank's partial sum;
        sum_topk False: (T, K, H) unsummed where there is no latent projection (fc2 needs the latent sum)."""
        m = lay.mods
        latent = "fc1_latent_proj" in m
        x = self.linear(h, m["fc1_latent_proj"], batch) if latent else h
        y = self.routed(x, ids, weights, lay, batch, use_lora, sum_topk or latent)
        return self.linear(y, m["fc2_latent_proj"], batch) if latent else y

    def routed(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        lay: Layer,
        batch: Batch,
        use_lora: bool = True,
        sum_topk: bool = True,
    ) -> torch.Tensor:
        """The routed experts alone on their (latent, where the model has one) input: this rank's partial; (T, K, H)
        unsummed with sum_topk False on the paths that can skip the sum (kernels.moe_forward)."""
        lora = lay.moe_lora if use_lora and batch.token_adapter is not None else None
        return moe_forward(
            MoeInputs(
                x,
                ids,
                weights,
                lay.need("w_up"),
                lay.need("w_down"),
                "relu2",
                lora=lora,
                token_adapter=batch.token_adapter,
            ),
            impl=self.lora_impl if lora is not None else self.impl,
            backend=self.moe_backend,
            sum_topk=sum_topk,
        )

    def shared(self, h: torch.Tensor, lay: Layer, batch: Batch) -> torch.Tensor:
        if faults.on("shared_expert_dropped"):
            return torch.zeros_like(h)
        return self.mlp(h, lay.mods["shared_experts.up_proj"], lay.mods["shared_experts.down_proj"], batch)

    @torch.inference_mode()
    def capture_modules(self, batch: Batch, inputs: dict, steps: tuple[int, ...] = ()) -> dict:
        """capture.py's module re-runs on another engine's inputs (capture.is_input), with the adapters and without
        ("_base"), all-reduced (full outputs on every rank): a mamba / attention / dense-MLP layer's mixer on its
        input point ("mamba_in", "attention_in", "mlp_in"; the output named alike); a MoE layer's router on the
        MoE input ("moe_in": this model's own routing), its routed experts on their input ("experts_in", after
        the latent projection where the model has one; HF's NemotronHExperts sees the same) with the reference's
        routing, and its shared expert ("shared_expert_in"). A mamba layer in ``steps`` also reports its mixer's
        sub-steps (capture.put_steps; TP 1)."""
        from lpdiff.engines.triton.capture import put_steps

        dev, dtype = self.w.embed.device, self.w.embed.dtype
        base = replace(batch, token_adapter=None, uniform_slot=None)  # every linear and the experts without LoRA
        cap: dict = {}

        def both(point: tuple[int, str], fn) -> None:
            h, (i, name) = inputs[point].to(dev, dtype), point
            for suffix, b in (("", batch), ("_base", base)):
                trace: dict | None = {} if i in steps else None
                cap[i, name.removesuffix("_in") + suffix] = self.all_reduce(fn(h, b, trace))
                if trace:
                    put_steps(cap, i, name.removesuffix("_in"), trace, suffix)

        for i, lay in enumerate(self.w.layers):
            if lay.kind == "M" and (i, "mamba_in") in inputs:
                both((i, "mamba_in"), lambda h, b, t, lay=lay: mamba_mixer(self, h, lay, b, t))
            elif lay.kind == "*" and (i, "attention_in") in inputs:
                both((i, "attention_in"), lambda h, b, t, lay=lay: self.attend(h, lay, b))
            elif lay.kind == "-" and (i, "mlp_in") in inputs:
                both((i, "mlp_in"), lambda h, b, t, lay=lay: self.mlp(h, lay.mods["up_proj"], lay.mods["down_proj"], b))
            elif lay.kind == "E":
                if (i, "moe_in") in inputs:
                    ids, weights, _ = self.route(inputs[i, "moe_in"].to(dev, dtype), lay)
                    cap[i, "router_ids"], cap[i, "router_weights"] = ids, weights
                if (i, "experts_in") in inputs:
                    ids, w32 = inputs[i, "router_ids"].to(dev), inputs[i, "router_weights"].to(dev).float()
                    both((i, "experts_in"), lambda x, b, t, lay=lay, ids=ids, w=w32: self.routed(x, ids, w, lay, b))
                if (i, "shared_expert_in") in inputs:
                    both((i, "shared_expert_in"), lambda h, b, t, lay=lay: self.shared(h, lay, b))
                if (i, "fc1_latent_proj_in") in inputs and "fc1_latent_proj" in lay.mods:
                    for suffix, b in (("", batch), ("_base", base)):
                        cap[i, "latent" + suffix] = self.latent(inputs, i, lay, b)
        return cap

    def latent(self, inputs: dict, i: int, lay: Layer, batch: Batch) -> torch.Tensor:
        """Super's two latent projections, each on the reference's input to it: (T, latent + hidden), all-reduced.
        fc1 is replicated; fc2 runs on each rank's partial expert sum in a forward, so here rank 0 alone feeds it the
        whole input (its bias is rank 0's too) and the all-reduce returns fc2's output once."""
        dev, dtype = self.w.embed.device, self.w.embed.dtype
        x, y = (inputs[i, f"{n}_in"].to(dev, dtype) for n in ("fc1_latent_proj", "fc2_latent_proj"))
        fc1 = self.linear(x, lay.mods["fc1_latent_proj"], batch)
        fc2 = self.all_reduce(
            self.linear(y if self.shard.first else torch.zeros_like(y), lay.mods["fc2_latent_proj"], batch)
        )
        return torch.cat([fc1, fc2], dim=-1)
