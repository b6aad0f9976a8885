"""The decoder stack shared by the supported MoE archs (their differences live in ModelConfig flags):
embed -> [RMSNorm -> attention -> +res -> RMSNorm -> router + experts -> +res] x N -> RMSNorm.
Each residual add is fused into the RMSNorm that follows it; at TP 1 so is the MoE's top-k sum. With q|k|v LoRA
in the batch (and not on the torch references) the input RMSNorm writes into the first H columns of the buffer
whose other columns take the LoRA shrink, and q|k|v is one GEMM with the LoRA as extra K (lora_linear_aug)."""

from __future__ import annotations

import torch

from lpdiff.engines.triton.attention import attention
from lpdiff.engines.triton.batch import Batch
from lpdiff.engines.triton.config import ModelConfig
from lpdiff.engines.triton.lora import LayerLora, StackedLora, session_lora_impl
from lpdiff.engines.triton.moe import experts, route
from lpdiff.engines.triton.norm import add_rms_norm, sum_topk
from lpdiff.engines.triton.rope import norm_rope_qk
from lpdiff.engines.triton.shard import Shard
from lpdiff.engines.triton.weights import LayerWeights, ModelWeights
from lpdiff.kernels import lora_linear
from lpdiff.kernels._triton import resolve_impl
from lpdiff.kernels.lora_linear import lora_linear_aug, lora_linear_shrink_out


class MoeTransformer:
    vocab = None  # vocab_lora.VocabLora of the session's adapters (set by the runtime), or None

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        lora: StackedLora | None,
        shard: Shard,
        all_reduce,
        impl: str = "auto",
        attention_impl: str = "auto",
        moe_backend: str = "triton",
        moe_shrink: tuple = ("auto", None),
        moe_padding: str | None = None,
    ):
        self.cfg, self.w, self.lora, self.shard = cfg, weights, lora, shard
        self.moe_shrink = moe_shrink  # (lora_shrink, n_tiles) of the expert GEMMs (options.parse_shrink)
        # the expert GEMMs' GemmConfig.padding; "auto" / None: the kernels' default (fused_moe_lora.auto_padding)
        self.moe_padding = None if moe_padding == "auto" else moe_padding
        self.all_reduce = all_reduce  # sums row-parallel partial outputs over the TP group (identity at TP 1)
        self.impl, self.attention_impl, self.moe_backend = impl, attention_impl, moe_backend
        self.lora_impl = session_lora_impl(impl, lora)
        # at TP 1 the experts hand back their unsummed top-k outputs (T, K, H) and the next add_rms_norm sums them;
        # under TP each rank's partial output is all-reduced, and summing first keeps that to one (T, H)
        self.fuse_topk_sum = shard.size == 1
        self.capture: dict | None = None  # opt-in (lpdiff bisect): layer index -> that layer's output hidden states
        qh, kvh = shard.heads(cfg.num_heads, cfg.num_kv_heads)
        self.heads, self.kv_heads = len(qh), len(kvh)
        d = cfg.head_dim
        self.qkv_offsets = [0, self.heads * d, (self.heads + self.kv_heads) * d, (self.heads + 2 * self.kv_heads) * d]

    def _norm(self, x, delta, weight, out=None):
        return add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps, self.cfg.norm_weight_fp32, self.impl, out)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> final-normed hidden states (T, H) and each token's smallest routing margin over layers (T,)."""
        cfg = self.cfg
        x = self.w.embed[batch.input_ids]
        if self.vocab is not None and (d := self.vocab.embed_delta(batch.input_ids, batch.token_adapter)) is not None:
            x = x + d  # embedding LoRA (vocab_lora.py)
        margin = torch.full((batch.num_tokens,), float("inf"), device=x.device)
        xa = self.qkv_input(batch, x)
        delta = None  # output of the last sublayer (or the MoE's top-k outputs), not yet added to the residual x
        for i, lw in enumerate(self.w.layers):
            ll = self.lora.layers[i] if self.lora is not None else None
            h, x = self._norm(x, delta, lw.input_norm, None if xa is None else xa[:, : cfg.hidden_size])
            delta = self.attend(h if xa is None else xa, lw, ll, batch, cfg.sliding_windows[i])
            h, x = self._norm(x, delta, lw.post_norm)
            ids, weights, margin = route(h, lw, cfg, self.impl, min_into=margin)
            delta = self.all_reduce(
                experts(
                    h,
                    ids,
                    weights,
                    lw,
                    cfg,
                    ll.moe if ll is not None else None,
                    batch.token_adapter,
                    self.lora_impl,
                    self.moe_backend,
                    sum_topk=not self.fuse_topk_sum,
                    shrink=self.moe_shrink,
                    padding=self.moe_padding,
                )
            )
            if self.capture is not None:
                self.capture[i] = x + sum_topk(delta)
        return self._norm(x, delta, self.w.norm)[0], margin

    def qkv_input(self, batch: Batch, x: torch.Tensor) -> torch.Tensor | None:
        """The (T, H + L*3*R) input of lora_linear_aug when this batch runs q|k|v LoRA as extra K (an adapter in
        the batch, q|k|v LoRA stacked, the vendor-GEMM path rather than the torch references), else None. One buffer
        serves every layer: each input norm overwrites its first H columns and each layer's shrink the rest. For a
        one-adapter batch only that slot's columns are ever written, so the others are zeroed once, here."""
        if self.lora is None or batch.token_adapter is None or self.lora.layers[0].qkv_w_aug is None:
            return None
        if resolve_impl(self.lora_impl, x) == "torch":
            return None
        shape = (x.shape[0], self.lora.layers[0].qkv_w_aug.shape[1])
        return x.new_zeros(shape) if batch.uniform_slot is not None else x.new_empty(shape)

    def qkv(self, h: torch.Tensor, lw: LayerWeights, ll: LayerLora | None, batch: Batch) -> torch.Tensor:
        """q|k|v of the normed input: h (T, H), or qkv_input's buffer with the normed input in its first H columns."""
        if h.shape[1] == lw.qkv.shape[1]:
            return self._linear(
                h,
                lw.qkv,
                lw.qkv_bias,
                ll and ll.qkv_a,
                ll and ll.qkv_b,
                ll and ll.qkv_b_packed,
                self.qkv_offsets,
                batch,
            )
        # h is qkv_input's buffer, which exists only when the layers' q|k|v LoRA is folded into W_aug
        assert ll is not None and ll.qkv_a is not None and ll.qkv_w_aug is not None
        uniform = batch.uniform_slot
        mask = batch.slot_mask(ll.qkv_a.shape[0], h.dtype) if uniform is None else None
        return lora_linear_aug(h, ll.qkv_w_aug, lw.qkv_bias, ll.qkv_a, mask, uniform, others_zero=True)

    def _linear(self, x, w, bias, lora_a, lora_b, b_packed, offsets, batch: Batch):
        if lora_a is None or batch.token_adapter is None or self.lora is None:
            return lora_linear(x, w, bias, impl=self.impl)
        # the pieces lora_linear's cublas path would otherwise rebuild per call: B packed per layer (lora.py),
        # the slot mask per batch, or no mask when every prompt uses one adapter
        uniform = batch.uniform_slot
        mask = batch.slot_mask(lora_a.shape[0], x.dtype) if uniform is None else None
        return lora_linear(
            x,
            w,
            bias,
            lora_a,
            lora_b,
            self.lora.scaling,
            offsets,
            batch.token_adapter,
            impl=self.lora_impl,
            b_packed=b_packed,
            slot_mask=mask,
            uniform_slot=uniform,
        )

    def attend(
        self, h: torch.Tensor, lw: LayerWeights, ll: LayerLora | None, batch: Batch, window: int | None
    ) -> torch.Tensor:
        """h: as qkv() takes it."""
        cfg, d, T = self.cfg, self.cfg.head_dim, h.shape[0]
        qkv = self.qkv(h, lw, ll, batch)
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k = norm_rope_qk(
            q.view(T, self.heads, d),
            k.view(T, self.kv_heads, d),
            lw.q_norm,
            lw.k_norm,
            cfg.rms_norm_eps,
            batch.cos,
            batch.sin,
            self.impl,
        )
        o = attention(q, k, v.view(T, self.kv_heads, d), batch, d**-0.5, window, lw.sinks, self.attention_impl).reshape(
            T, self.heads * d
        )
        return self.all_reduce(self.o_proj(o, lw, ll, batch))

    def o_proj(self, o: torch.Tensor, lw: LayerWeights, ll: LayerLora | None, batch: Batch) -> torch.Tensor:
        """o (T, heads * d) -> (T, H), this rank's partial sum under TP."""
        if (
            ll is not None
            and ll.o_w_s is not None
            and ll.o_a is not None
            and batch.token_adapter is not None
            and resolve_impl(self.lora_impl, o) != "torch"
        ):
            uniform = batch.uniform_slot
            mask = batch.slot_mask(ll.o_a.shape[0], o.dtype) if uniform is None else None
            # a (T, H) view with row stride H + L*R: the next add_rms_norm reads it as it is (TP 1 only)
            return lora_linear_shrink_out(
                o, ll.o_w_s, ll.o_bias_s, lw.o.shape[0], ll.o_b_packed, ll.o_a.shape[1] * ll.o_a.shape[2], mask, uniform
            )
        return self._linear(o, lw.o, lw.o_bias, ll and ll.o_a, ll and ll.o_b, ll and ll.o_b_packed, None, batch)
