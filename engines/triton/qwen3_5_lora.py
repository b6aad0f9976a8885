"""Qwen3.5-MoE's dense projections as fused linears (parts concatenated on their output rows, one GEMM, LoRA per
part), how each is sharded for a tensor-parallel rank, and adapters stacked into L slots for them.

Every dense LoRA target of the generator's groups is a part of one fused linear: linear_attention (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a -> ``proj_in``; out_proj -> ``proj_out``), attention (q_proj, k_proj, v_proj ->
``proj_in``; o_proj -> ``proj_out``), shared_expert (gate_proj, up_proj -> ``shared_gate_up``; down_proj ->
``shared_down``). Experts (PEFT 3D, or per-expert fused by harness.spec.adapters) go to kernels.MoeLoraWeights as in
lora.py. Slot buffers start as zeros, so a slot without a module and padded rank columns add exactly nothing.
Sharding as shard.py: column-parallel parts split their rows (B's rows too, A replicated), row-parallel linears split
their input columns (A's columns too, B whole); the all-reduce after a row-parallel linear sums partial deltas.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lpdiff.engines.triton.lora import AdapterSlots, sharded_moe_lora
from lpdiff.engines.triton.shard import Shard
from lpdiff.kernels import MoeLoraWeights
from lpdiff.kernels.lora_linear import pack_lora_b

Tensor = torch.Tensor
Split = Callable[[Tensor, int], Tensor]
SUPPORTED_TARGETS = (
    "linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}, "
    "self_attn.{q,k,v,o}_proj, mlp.shared_expert.{gate,up,down}_proj, "
    "mlp.experts.{gate_up_proj,down_proj}"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(slots=True)
class Linear:
    w: Tensor  # (N_loc, in_loc): the parts' local rows concatenated
    offsets: tuple[int, ...] | None  # the parts' row boundaries (None: one part)

    @classmethod
    def of(cls, parts: list[Tensor]) -> Linear:
        w = torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.shape[0])
        return cls(w, tuple(bounds) if len(parts) > 1 else None)


@dataclass(slots=True)
class LinearSpec:
    parts: list[tuple[str, Split]]  # (module path under model.layers.{i}., this rank's rows of it along a dim)
    cols: Split | None = None  # this rank's input columns (row-parallel), None: replicated input


def layer_linears(cfg, kind: str, shard: Shard) -> dict[str, LinearSpec]:
    """The fused linears of one layer of ``kind`` and how each part is sharded."""
    split = shard.split
    if kind == "linear_attention":
        kd, vd = cfg.lin_k_heads * cfg.lin_k_dim, cfg.lin_v_heads * cfg.lin_v_dim

        def qkv_rows(t: Tensor, dim: int) -> Tensor:  # q and k by key heads, v by value heads
            return torch.cat([split(x, dim) for x in t.split([kd, kd, vd], dim)], dim)

        a = "linear_attn."
        linears = {
            "proj_in": LinearSpec(
                [
                    (a + "in_proj_qkv", qkv_rows),
                    (a + "in_proj_z", split),
                    (a + "in_proj_b", split),
                    (a + "in_proj_a", split),
                ]
            ),
            "proj_out": LinearSpec([(a + "out_proj", _whole)], split),
        }
    else:
        d = cfg.head_dim
        qh, kvh = shard.heads(cfg.num_heads, cfg.num_kv_heads)
        a = "self_attn."
        linears = {
            "proj_in": LinearSpec(
                [
                    (
                        a + "q_proj",
                        lambda t, dim: t.narrow(dim, qh.start * 2 * d, len(qh) * 2 * d),
                    ),  # query | gate per head
                    (
                        a + "k_proj",
                        lambda t, dim: t.narrow(dim, kvh.start * d, len(kvh) * d),
                    ),  # kv heads may be replicated
                    (a + "v_proj", lambda t, dim: t.narrow(dim, kvh.start * d, len(kvh) * d)),
                ]
            ),
            "proj_out": LinearSpec([(a + "o_proj", _whole)], split),
        }
    se = "mlp.shared_expert."
    linears["shared_gate_up"] = LinearSpec([(se + "gate_proj", split), (se + "up_proj", split)])
    linears["shared_down"] = LinearSpec([(se + "down_proj", _whole)], split)
    return linears


def _whole(t: Tensor, dim: int) -> Tensor:
    return t


def load_linear(spec: LinearSpec, take: Callable[[str], Tensor], prefix: str) -> Linear:
    parts = [rows(take(prefix + name + ".weight"), 0) for name, rows in spec.parts]
    if spec.cols is not None:
        parts = [spec.cols(p, 1) for p in parts]
    return Linear.of(parts)


@dataclass(slots=True)
class LinearLora:
    a: Tensor  # (L, S, R, in_loc)
    b: Tensor  # (L, N_loc, R)
    b_packed: Tensor  # kernels.lora_linear.pack_lora_b(b, scaling, offsets)


@dataclass(slots=True)
class LayerLora:
    proj_in: LinearLora | None = None
    proj_out: LinearLora | None = None
    shared_gate_up: LinearLora | None = None
    shared_down: LinearLora | None = None
    moe: MoeLoraWeights | None = None


@dataclass(slots=True)
class Qwen35Lora(AdapterSlots):
    layers: list[LayerLora]

    def nbytes(self) -> int:
        total = 0
        for ll in self.layers:
            for lin in (ll.proj_in, ll.proj_out, ll.shared_gate_up, ll.shared_down):
                if lin is not None:
                    total += sum(t.numel() * t.element_size() for t in (lin.a, lin.b, lin.b_packed))
            if ll.moe is not None:
                m = ll.moe
                total += sum(t.numel() * t.element_size() for t in (m.gate_up_a, m.gate_up_b, m.down_a, m.down_b))
        return total


def _by_layer(cfg, name: str, adapter) -> dict[int, dict[str, tuple]]:
    """{layer: {path under the layer: (A, B)}} for layers < num_layers; a target this engine does not run fails."""
    out: dict[int, dict[str, tuple]] = {}
    for key, ab in [*adapter.dense.items(), *adapter.experts.items()]:
        m = _LAYER.match(key)
        if m is None:
            raise ValueError(
                f"adapter {name!r} targets {key!r}, which the triton engine does not run LoRA on for "
                f"Qwen3.5; supported targets: {SUPPORTED_TARGETS}"
            )
        if int(m.group(1)) < cfg.num_layers:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = ab
    return out


def stack_qwen35(cfg, weights, adapters: dict, shard: Shard, dtype, device) -> Qwen35Lora | None:
    """``adapters``: name -> harness CanonicalAdapter, in slot order."""
    if not adapters:
        return None
    names = list(adapters)
    ranks_of = {n: max({int(a.rank)} | a.inner_dims) for n, a in adapters.items()}
    L, R = len(names), max(ranks_of.values())
    parsed = [_by_layer(cfg, n, adapters[n]) for n in names]
    scaling = torch.tensor([float(adapters[n].scaling) for n in names], dtype=torch.float32, device=device)
    ranks = torch.tensor([ranks_of[n] for n in names], dtype=torch.int32, device=device)
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.expert_width

    def put(dst: Tensor, src: Tensor) -> None:
        dst[tuple(slice(0, s) for s in src.shape)] = src.to(device=device, dtype=dtype)

    layers = []
    for li in range(cfg.num_layers):
        lw = weights.layers[li]
        ll, used = LayerLora(), set()
        for lname, spec in layer_linears(cfg, cfg.layer_types[li], shard).items():
            if not any(part in p.get(li, {}) for p in parsed for part, _ in spec.parts):
                continue
            lin = getattr(lw, lname) if hasattr(lw, lname) else getattr(lw.moe, lname)
            full_in = lin.w.shape[1] * (1 if spec.cols is None else shard.size)
            a = torch.zeros(L, len(spec.parts), R, full_in, dtype=dtype, device=device)
            bs = []
            for j, (part, rows) in enumerate(spec.parts):
                used.add(part)
                b_full = torch.zeros(L, _out_rows(cfg, part), R, dtype=dtype, device=device)
                for s, p in enumerate(parsed):
                    if part in p.get(li, {}):
                        A, B = p[li][part]
                        put(a[s, j], A)
                        put(b_full[s], B)
                bs.append(rows(b_full, 1))
            if spec.cols is not None:
                a = spec.cols(a, 3)
            b = torch.cat(bs, dim=1).contiguous()
            assert b.shape[1] == lin.w.shape[0] and a.shape[3] == lin.w.shape[1], (lname, b.shape, a.shape)
            setattr(ll, lname, LinearLora(a.contiguous(), b, pack_lora_b(b, scaling, lin.offsets, R)))
        if any("mlp.experts.gate_up_proj" in p.get(li, {}) or "mlp.experts.down_proj" in p.get(li, {}) for p in parsed):
            gu_a, gu_b = _zeros(dtype, device, L, E, R, H), _zeros(dtype, device, L, E, 2 * I, R)
            dn_a, dn_b = _zeros(dtype, device, L, E, R, I), _zeros(dtype, device, L, E, H, R)
            for s, p in enumerate(parsed):
                ex = p.get(li, {})
                if "mlp.experts.gate_up_proj" in ex:  # rows gate then up: the kernels' order already
                    put(gu_a[s], ex["mlp.experts.gate_up_proj"][0])
                    put(gu_b[s], ex["mlp.experts.gate_up_proj"][1])
                if "mlp.experts.down_proj" in ex:
                    put(dn_a[s], ex["mlp.experts.down_proj"][0])
                    put(dn_b[s], ex["mlp.experts.down_proj"][1])
            used |= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
            ll.moe = sharded_moe_lora((gu_a, gu_b, dn_a, dn_b), scaling, ranks, shard)
        for n, p in zip(names, parsed):
            unknown = set(p.get(li, {})) - used
            if unknown:
                raise ValueError(
                    f"adapter {n!r} targets model.layers.{li}.{min(unknown)}, which the triton "
                    f"engine does not run LoRA on for Qwen3.5 (layer {li} is "
                    f"{cfg.layer_types[li]}); supported targets: {SUPPORTED_TARGETS}"
                )
        layers.append(ll)
    return Qwen35Lora(names=names, scaling=scaling, ranks=ranks, layers=layers)


def _zeros(dtype, device, *shape) -> Tensor:
    return torch.zeros(*shape, dtype=dtype, device=device)


def _out_rows(cfg, part: str) -> int:
    """Output rows of a part no slot's adapter has (its B stays zeros)."""
    d, kd = cfg.head_dim, cfg.lin_k_heads * cfg.lin_k_dim
    vd = cfg.lin_v_heads * cfg.lin_v_dim
    return {
        "linear_attn.in_proj_qkv": 2 * kd + vd,
        "linear_attn.in_proj_z": vd,
        "linear_attn.in_proj_b": cfg.lin_v_heads,
        "linear_attn.in_proj_a": cfg.lin_v_heads,
        "linear_attn.out_proj": cfg.hidden_size,
        "self_attn.q_proj": 2 * cfg.num_heads * d,
        "self_attn.k_proj": cfg.num_kv_heads * d,
        "self_attn.v_proj": cfg.num_kv_heads * d,
        "self_attn.o_proj": cfg.hidden_size,
        "mlp.shared_expert.gate_proj": cfg.shared_width,
        "mlp.shared_expert.up_proj": cfg.shared_width,
        "mlp.shared_expert.down_proj": cfg.hidden_size,
    }[part]
