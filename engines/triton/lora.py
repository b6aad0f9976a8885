"""Stack several adapters into L slots per layer, zero-padded to the largest rank, in the kernels' layouts and
sharded for this tensor-parallel rank. Each prompt then picks a slot (or -1 for none) per token.

Input: canonical adapters (harness.adapters.CanonicalAdapter): ``dense`` {module: (A (r, in), B (out, r))} and
``experts`` {param: (A (E, r, in), B (E, out, r))}, (out, in) orientation, rows in the HF parameter's order.
Buffers start as zeros so unused slots and padded rank columns contribute exactly nothing.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lpdiff.engines.triton.archs import arch_module
from lpdiff.engines.triton.config import ModelConfig
from lpdiff.engines.triton.shard import Shard
from lpdiff.kernels import MoeLoraWeights, faults
from lpdiff.kernels.lora_linear import augment_weight, pack_lora_b, stack_shrink_rows

if TYPE_CHECKING:
    from lpdiff.harness.spec.adapters import CanonicalAdapter

Tensor = torch.Tensor
_DENSE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
SUPPORTED_TARGETS = "self_attn.{q,k,v,o}_proj and mlp.experts.{gate_up_proj,down_proj}"


@dataclass(slots=True)
class LayerLora:
    qkv_a: Tensor | None  # (L, 3, R, H)
    qkv_b: Tensor | None  # (L, q_loc + 2 kv_loc, R)
    o_a: Tensor | None  # (L, 1, R, q_loc)
    o_b: Tensor | None  # (L, H, R)
    moe: MoeLoraWeights | None
    # B of q|k|v and o for lora_linear's cublas path (kernels.lora_linear.pack_lora_b, scaling folded in), built
    # once here so that a forward does no per-layer packing: (q_loc + 2 kv_loc, L*3*R) and (H, L*R)
    qkv_b_packed: Tensor | None = None
    o_b_packed: Tensor | None = None
    # [W_qkv | qkv_b_packed] (q_loc + 2 kv_loc, H + L*3*R) for kernels.lora_linear_aug (the q|k|v LoRA as extra K
    # columns of the base GEMM), set by fold_qkv_lora; the layer's weight and qkv_b_packed are then views into it
    qkv_w_aug: Tensor | None = None
    # [W_o ; o's A of every slot] (H + L*R, q_loc) and its bias [b_o ; 0] for kernels.lora_linear_shrink_out (o's
    # shrink as extra output rows of the base GEMM), set by fold_o_lora at TP 1; the layer's o is then a view
    o_w_s: Tensor | None = None
    o_bias_s: Tensor | None = None


@dataclass(slots=True)
class AdapterSlots:
    """A session's adapters by slot, whatever the arch keeps per layer (subclasses add it and ``nbytes``)."""

    names: list[str]  # slot -> adapter name
    scaling: Tensor  # (L,) float32
    ranks: Tensor  # (L,) int32

    def slot(self, name: str | None) -> int:
        return -1 if name is None else self.names.index(name)


def sharded_moe_lora(
    factors: tuple[Tensor, Tensor, Tensor, Tensor], scaling: Tensor, ranks: Tensor, shard: Shard, gated: bool = True
) -> MoeLoraWeights:
    """The stacked expert factors (gate_up A, B, down A, B, every expert's whole) as this rank's MoeLoraWeights: the
    experts' intermediate columns are split across ranks, so gate_up's B rows (each of gate and up, when gated) and
    down's A columns are split; gate_up's A and down's B stay whole."""
    gu_a, gu_b, dn_a, dn_b = factors
    gu_b = shard.split_gate_up(gu_b, 2) if gated else shard.split(gu_b, 2)
    return MoeLoraWeights(gu_a, gu_b.contiguous(), shard.split(dn_a, 3).contiguous(), dn_b, scaling, ranks)


@dataclass(slots=True)
class StackedLora(AdapterSlots):
    layers: list[LayerLora]

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            ts = [layer.qkv_a, layer.qkv_b, layer.o_a, layer.o_b, layer.qkv_b_packed, layer.o_b_packed]
            if layer.moe is not None:
                ts += [layer.moe.gate_up_a, layer.moe.gate_up_b, layer.moe.down_a, layer.moe.down_b]
            if (
                layer.o_w_s is not None and layer.o_b is not None
            ):  # the A rows stacked under W_o (its first H rows are the weight itself)
                ts.append(layer.o_w_s[layer.o_b.shape[1] :])
            total += sum(t.numel() * t.element_size() for t in ts if t is not None)
        return total


def _parse(cfg: ModelConfig, name: str, adapter) -> tuple[dict, dict]:
    """-> ({layer: {proj: (A, B)}}, {layer: {param: (A, B)}}) for layers < num_layers; unknown targets fail."""
    experts = _by_layer(cfg, name, adapter.experts, _EXPERT)
    if faults.on("expert_adapter_dropped"):
        experts = {}
    return _by_layer(cfg, name, adapter.dense, _DENSE), experts


def _by_layer(cfg: ModelConfig, name: str, entries: dict, pattern: re.Pattern) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for key, ab in entries.items():
        m = pattern.match(key)
        if m is None:
            raise ValueError(
                f"adapter {name!r} targets {key!r}, which the triton engine does not run LoRA on; "
                f"supported targets: {SUPPORTED_TARGETS}"
            )
        if int(m.group(1)) < cfg.num_layers:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = ab
    return out


def stack_adapters(
    cfg: ModelConfig, adapters: dict[str, CanonicalAdapter], shard: Shard, dtype: torch.dtype, device: torch.device
) -> StackedLora | None:
    """``adapters``: name -> CanonicalAdapter, in slot order."""
    if not adapters:
        return None
    arch = arch_module(cfg.arch)
    names = list(adapters)
    ranks_of = {n: _rank(a) for n, a in adapters.items()}
    L, R = len(names), max(ranks_of.values())
    parsed = [_parse(cfg, n, adapters[n]) for n in names]
    any_dense = any(d for d, _ in parsed)
    any_experts = any(e for _, e in parsed)
    H, E, d = cfg.hidden_size, cfg.num_experts, cfg.head_dim
    heads = (cfg.num_heads, cfg.num_kv_heads, d)
    q_heads, kv_heads = shard.heads(cfg.num_heads, cfg.num_kv_heads)
    q_loc, kv_loc = len(q_heads) * d, len(kv_heads) * d
    qkv_loc_offsets = (0, q_loc, q_loc + kv_loc, q_loc + 2 * kv_loc)  # this rank's q|k|v columns
    n_qkv = cfg.q_size + 2 * cfg.kv_size
    I2, I = 2 * cfg.expert_width, cfg.expert_width

    def z(*shape) -> Tensor:
        if faults.on("lora_uninitialised"):
            return faults.stale_empty(*shape, dtype=dtype, device=device)
        return torch.zeros(*shape, dtype=dtype, device=device)

    def put(dst: Tensor, src: Tensor) -> None:
        """Copy a (possibly lower-rank) factor into a zero-padded slot; rank is dim -2 for A, -1 for B."""
        if faults.on("lora_rank_layout"):
            faults.flat_put(dst, src)
            return
        dst[tuple(slice(0, s) for s in src.shape)] = src.to(device=device, dtype=dtype)

    scaling = torch.tensor([float(adapters[n].scaling) for n in names], dtype=torch.float32, device=device)
    ranks = torch.tensor([ranks_of[n] for n in names], dtype=torch.int32, device=device)
    layers = []
    for li in range(cfg.num_layers):
        qkv_a = qkv_b_full = o_a_full = o_b = None
        if any_dense:
            qkv_a, qkv_b_full = z(L, 3, R, H), z(L, n_qkv, R)
            o_a_full, o_b = z(L, 1, R, cfg.q_size), z(L, H, R)
            offsets = {"q": 0, "k": cfg.q_size, "v": cfg.q_size + cfg.kv_size}
            for s, (dense, _) in enumerate(parsed):
                for proj, (A, B) in dense.get(li, {}).items():
                    if proj == "o":
                        put(o_a_full[s, 0], A)
                        put(o_b[s], B)
                    else:
                        put(qkv_a[s, "qkv".index(proj)], A)
                        put(qkv_b_full[s, offsets[proj] : offsets[proj] + B.shape[0]], B)
        moe = None
        if any_experts:
            gu_a, gu_b, dn_a, dn_b = z(L, E, R, H), z(L, E, I2, R), z(L, E, R, I), z(L, E, H, R)
            for s, (_, experts) in enumerate(parsed):
                ex = experts.get(li, {})
                if "gate_up_proj" in ex:
                    A, B = ex["gate_up_proj"]
                    put(gu_a[s], A)
                    put(gu_b[s], B if faults.on("gpt_oss_gate_up_concat") else arch.gate_up_rows(B, 1))
                if "down_proj" in ex:
                    A, B = ex["down_proj"]
                    put(dn_a[s], A)
                    put(dn_b[s], B)
            moe = sharded_moe_lora((gu_a, gu_b, dn_a, dn_b), scaling, ranks, shard)
        qkv_b = None if qkv_b_full is None else shard.split_qkv(qkv_b_full, 1, *heads).contiguous()
        # o is row-parallel: A split on its input, B whole; each rank expands its partial shrink with the whole
        # packed B and the all-reduce of o's output sums the partial deltas (linear in the shrink)
        layers.append(
            LayerLora(
                qkv_a=qkv_a,
                qkv_b=qkv_b,
                o_a=None if o_a_full is None else shard.split_heads(o_a_full, 3, *heads).contiguous(),
                o_b=o_b,
                moe=moe,
                qkv_b_packed=None if qkv_b is None else pack_lora_b(qkv_b, scaling, qkv_loc_offsets, R),
                o_b_packed=None if o_b is None else pack_lora_b(o_b, scaling, None, R),
            )
        )
        o_a = layers[-1].o_a
        assert qkv_a is None or (o_a is not None and o_a.shape[-1] == q_loc)
    return StackedLora(names=names, scaling=scaling, ranks=ranks, layers=layers)


def fold_qkv_lora(weights, lora: StackedLora | None) -> None:
    """Store each layer's q|k|v weight once, as W_aug = [W | B_packed] (kernels.lora_linear.augment_weight): the
    layer's ``qkv`` becomes the view W_aug[:, :H] (base-only batches) and ``qkv_b_packed`` the view W_aug[:, H:].
    Under TP both W and B_packed hold this rank's q|k|v rows, so W_aug is sharded row-wise like them."""
    if lora is None:
        return
    for lw, ll in zip(weights.layers, lora.layers):
        if ll.qkv_b_packed is None:
            continue
        H = lw.qkv.shape[1]
        ll.qkv_w_aug = augment_weight(lw.qkv, ll.qkv_b_packed)
        lw.qkv, ll.qkv_b_packed = ll.qkv_w_aug[:, :H], ll.qkv_w_aug[:, H:]


def fold_o_lora(weights, lora: StackedLora | None, shard: Shard) -> None:
    """Store each layer's o weight once, as W_s = [W_o ; A_all] (kernels.lora_linear.stack_shrink_rows): the layer's
    ``o`` becomes the contiguous view W_s[:H]. TP 1 only: under TP the o output is all-reduced, which needs it
    contiguous, while lora_linear_shrink_out returns a view of a wider product."""
    if lora is None or shard.size != 1:
        return
    for lw, ll in zip(weights.layers, lora.layers):
        if ll.o_a is None:
            continue
        H = lw.o.shape[0]
        ll.o_w_s, ll.o_bias_s = stack_shrink_rows(lw.o, ll.o_a, lw.o_bias)
        lw.o = ll.o_w_s[:H]


def _rank(adapter) -> int:
    """Inner dimension of the slot: per-expert gate/up with different A matrices fuse at 2r (harness.adapters)."""
    return max({int(adapter.rank)} | {a.shape[-2] for a, _ in [*adapter.dense.values(), *adapter.experts.values()]})


def session_lora_impl(impl: str, lora) -> str:
    """The impl a session's LoRA-bearing layers run on. The LoRA kernels hold a (rows, rank) accumulator in registers
    up to rank KERNEL_MAX_RANK; a larger adapter (e.g. the exact shared-outer form, rank E*r) runs those layers on
    the kernels' torch references instead."""
    from lpdiff.kernels import MAX_RANK as KERNEL_MAX_RANK

    if lora is not None and int(lora.ranks.max()) > KERNEL_MAX_RANK:
        warnings.warn(
            f"adapter rank {int(lora.ranks.max())} > {KERNEL_MAX_RANK}: the LoRA layers of this session "
            "run on the kernels' torch references",
            stacklevel=3,
        )
        return "torch"
    return impl
