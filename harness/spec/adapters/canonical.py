"""The canonical in-memory adapter (W' = W + scaling * B @ A per module and per expert), read from either disk
layout and merged into a model exactly as PEFT merges it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lpdiff.harness.spec.adapters.files import load_tensors, read_config
from lpdiff.harness.spec.adapters.layout import EMBED_KEY_RE, ModelLayout, pattern_value
from lpdiff.harness.spec.errors import InputError


def peft_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """Exactly as PEFT computes it (Python floats)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(slots=True)
class CanonicalAdapter:
    """An adapter in one in-memory form, whatever its disk layout.

    Math contract, every entry in (out, in) orientation: W' = W + scaling * B @ A; for experts, per expert e,
    W'_e = W_e + scaling * B[e] @ A[e]. This equals PEFT's merged weight (for gpt-oss, whose parameter is stored
    (E, in, out), compare against the transposed parameter). Expert output rows stay in the HF parameter's own
    order: gpt-oss gate_up rows remain interleaved (gate = rows 0::2, up = rows 1::2), the others are [gate; up].

    An entry's inner dimension can exceed `rank`: per-expert gate and up projections with different A matrices
    fuse exactly into one gate_up entry of inner dimension 2*rank (A stacked, B block-structured). `scaling` is
    the adapter's (``r``, ``lora_alpha``, ``use_rslora``); ``scalings`` holds the entries whose scaling differs
    (``rank_pattern`` / ``alpha_pattern``, resolved as PEFT resolves them): ``scaling_of(name)`` is an entry's.

    ``embed``: Embedding LoRA in PEFT's own layout, {module: (A (r, vocab), B (hidden, r))}: the delta of the
    (vocab, hidden) weight is scaling * (B @ A)^T, so x = E[ids] + scaling * A^T[ids] @ B^T. An ``lm_head`` LoRA
    is a ``dense`` entry like any Linear.
    """

    rank: int
    alpha: float
    use_rslora: bool
    scaling: float
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A (r, in), B (out, r))
    experts: dict[str, tuple[torch.Tensor, torch.Tensor]]  # param path -> (A (E, r, in), B (E, out, r))
    config: dict[str, Any] = field(default_factory=dict)  # the adapter_config.json it was read from
    layout: str = "peft3d"  # the disk layout it was read from: one of LAYOUTS or dense_only
    embed: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # (A (r, V), B (H, r))
    scalings: dict[str, float] = field(default_factory=dict)  # entry -> its scaling, where it differs from scaling

    def __post_init__(self):
        assert self.scaling == peft_scaling(self.alpha, self.rank, self.use_rslora)
        assert set(self.scalings) <= {*self.dense, *self.experts, *self.embed}, sorted(self.scalings)
        for name, (a, b) in self.embed.items():
            assert a.ndim == 2 and b.ndim == 2 and a.shape[0] == b.shape[1], f"{name}: A {a.shape} B {b.shape}"
        for name, (a, b) in self.dense.items():
            assert a.ndim == 2 and b.ndim == 2 and a.shape[0] == b.shape[1], f"{name}: A {a.shape} B {b.shape}"
        for name, (a, b) in self.experts.items():
            assert a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2], (
                f"{name}: A {a.shape} B {b.shape}"
            )

    def scaling_of(self, name: str) -> float:
        """The scaling of one entry (a module's rank_pattern / alpha_pattern, else the adapter's)."""
        return self.scalings.get(name, self.scaling)

    def delta(self, name: str) -> torch.Tensor:
        """scaling * B @ A in (out, in) orientation ((E, out, in) for experts; (vocab, hidden) for an embedding,
        the weight's own orientation), in fp32."""
        if name in self.embed:
            a, b = self.embed[name]
            return self.scaling_of(name) * (b.float() @ a.float()).T
        a, b = self.dense[name] if name in self.dense else self.experts[name]
        return self.scaling_of(name) * (b.float() @ a.float())

    @property
    def inner_dims(self) -> set[int]:
        return {a.shape[-2] for a, _ in [*self.dense.values(), *self.experts.values(), *self.embed.values()]}


def as_layout(model_config) -> ModelLayout:
    return model_config if isinstance(model_config, ModelLayout) else ModelLayout.from_config(model_config)


def load_canonical(adapter_dir: str | Path, model_config) -> CanonicalAdapter:
    """Read an adapter in either disk layout. `model_config`: the base model's transformers config (or a dict,
    or a ModelLayout); it decides which key is which parameter and how fused rows split."""
    adapter_dir = Path(adapter_dir)
    cfg = read_config(adapter_dir)
    layout = as_layout(model_config)
    pairs: dict[tuple, dict[str, torch.Tensor]] = {}  # (kind, ...) -> {"A": t, "B": t}
    renamed = False  # per_expert_gate: a non-gated expert's input saved as gate_proj
    for key, t in load_tensors(adapter_dir).items():
        if _saved_base_layer(key, layout):
            # PEFT's save_embedding_layers ("auto": on when an embedding is targeted) stores the base embedding and
            # lm_head beside the LoRA: a resized vocabulary would show as a shape mismatch, and a plain copy
            # changes nothing; lpdiff judges the LoRA on the model's own base weights
            continue
        mod, which = layout.memory_path(key)
        if mod in layout.embeddings:
            if not EMBED_KEY_RE.fullmatch(key):
                raise InputError(f"{key}: {mod} is an embedding; PEFT saves its LoRA as lora_embedding_A/B")
            ident: tuple = ("embed", mod)
            slot = pairs.setdefault(ident, {})
            slot[which] = t
            continue
        try:
            ident = layout.tensor_slot(mod, cfg.get("target_parameters"))
        except ValueError as e:
            raise InputError(f"{key}: {e}") from None
        renamed |= ident[0] == "pe" and not mod.endswith("." + ident[2])
        slot = pairs.setdefault(ident, {})
        if which in slot:
            raise InputError(f"{key}: two tensors map to the same LoRA {which} of {ident[1]}")
        slot[which] = t
    for ident, slot in pairs.items():
        if set(slot) != {"A", "B"}:
            raise InputError(f"{adapter_dir}: {ident[1]} has lora_{''.join(slot)} but not both A and B")

    Pair = tuple[torch.Tensor, torch.Tensor]
    dense: dict[str, Pair] = {}
    experts: dict[str, Pair] = {}
    embed: dict[str, Pair] = {}
    per_expert: dict[str, dict[str, dict[int, tuple]]] = {}  # experts module -> projection -> expert -> (A, B)
    for ident, s in pairs.items():
        if ident[0] == "embed":
            vocab, hidden = layout.embeddings[ident[1]]
            a, b = s["A"], s["B"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != vocab or b.shape[0] != hidden or a.shape[0] != b.shape[1]:
                raise InputError(
                    f"{ident[1]}: lora_embedding_A {tuple(a.shape)} / lora_embedding_B {tuple(b.shape)} "
                    f"do not fit the model's (vocab={vocab}, hidden={hidden}): PEFT writes A (r, vocab), "
                    "B (hidden, r); is the adapter for a resized vocabulary?"
                )
            embed[ident[1]] = (a, b)
        elif ident[0] == "dense":
            out_f, in_f = layout.linears[ident[1]]
            _check_shapes(ident[1], s["A"], s["B"], in_f, out_f)
            dense[ident[1]] = (s["A"], s["B"])
        elif ident[0] == "3d":
            p = layout.experts[ident[1]]
            E = p.num_experts
            a, b = s["A"], s["B"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] % E or b.shape[1] % E:
                raise InputError(
                    f"{ident[1]}: A {tuple(a.shape)} / B {tuple(b.shape)} are not (r*{E}, in) / (out, r*{E})"
                )
            a = a.reshape(E, -1, a.shape[-1])
            b = b.reshape(b.shape[0], -1, E).permute(2, 0, 1).contiguous()
            _check_shapes(ident[1], a, b, p.in_features, p.out_features)
            experts[ident[1]] = (a, b)
        else:
            per_expert.setdefault(ident[1], {}).setdefault(ident[2], {})[ident[3]] = (s["A"], s["B"])
    for module, projs in per_expert.items():
        experts.update(_fuse_per_expert(layout, module, projs))

    layout_name = "peft3d" if experts else "dense_only"
    if per_expert:
        layout_name = "per_expert_gate" if renamed else "per_expert"
    if per_expert and any(ident[0] == "3d" for ident in pairs):
        raise InputError(f"{adapter_dir} mixes the peft3d and per_expert expert layouts")
    rank, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    scaling = peft_scaling(alpha, rank, rslora)
    scalings = {}
    for name in [*dense, *experts, *embed]:
        sc = entry_scaling(cfg, _pattern_names(layout, name, per_expert), rank, alpha, rslora)
        if sc != scaling:
            scalings[name] = sc
    return CanonicalAdapter(rank, alpha, rslora, scaling, dense, experts, cfg, layout_name, embed, scalings)


def _saved_base_layer(key: str, layout: ModelLayout) -> bool:
    """A base weight PEFT saved beside the LoRA (save_embedding_layers) of an embedding or lm_head."""
    if not key.endswith(".base_layer.weight"):
        return False
    mod = layout.memory_path(key.removesuffix(".base_layer.weight") + ".lora_A.weight")[0]
    return mod in layout.embeddings or mod.rsplit(".", 1)[-1] == "lm_head"


def entry_scaling(cfg: dict, paths: list[str], rank: int, alpha: float, rslora: bool) -> float:
    """The scaling PEFT gives the module(s) at ``paths`` (every one must get the same: they make one entry)."""
    got = set()
    for path in paths:
        r = pattern_value(cfg.get("rank_pattern"), path)
        a = pattern_value(cfg.get("alpha_pattern"), path)
        got.add(peft_scaling(float(alpha if a is None else a), int(rank if r is None else r), rslora))
    if len(got) != 1:
        raise InputError(
            f"rank_pattern / alpha_pattern give the parts of {paths[0]} different scalings "
            f"({sorted(got)}), which one fused entry cannot carry; give them one rank and alpha"
        )
    return got.pop()


def _pattern_names(layout: ModelLayout, name: str, per_expert: dict) -> list[str]:
    """The module paths PEFT matches patterns against for one canonical entry: the module (or, for PEFT's 3D
    experts, the parameter path); for an entry fused from per-expert files, every expert's projection modules."""
    p = layout.experts.get(name)
    if p is None or p.module not in per_expert:
        return [name]
    parts = per_expert[p.module]
    return [f"{p.module}.{e}.{part}" for part in p.parts if part in parts for e in range(p.num_experts)] or [name]


def _check_shapes(name: str, a: torch.Tensor, b: torch.Tensor, in_f: int, out_f: int) -> None:
    if a.shape[-1] != in_f or b.shape[-2] != out_f or a.shape[-2] != b.shape[-1]:
        raise InputError(
            f"{name}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the model's "
            f"(out={out_f}, in={in_f}); is the adapter for another model size?"
        )


def _fuse_per_expert(layout: ModelLayout, module: str, projs: dict[str, dict[int, tuple]]):
    """Per-expert gate/up/down matrices -> canonical fused entries. Parts that share A (as a peft3d adapter
    converted to per_expert does) fuse at rank r; otherwise A is stacked and B is block-structured (rank k*r),
    which is exact too. A missing part contributes zero rows."""
    out = {}
    used = set()
    for pname in layout.module_params[module]:
        p = layout.experts[f"{module}.{pname}"]
        present = [(j, part) for j, part in enumerate(p.parts) if part in projs]
        if not present:
            continue
        A, B = [], []
        for _, part in present:
            used.add(part)
            got = projs[part]
            if sorted(got) != list(range(p.num_experts)):
                raise InputError(
                    f"{module}.<e>.{part}: the adapter has {len(got)} experts (indices {min(got)}.."
                    f"{max(got)}) but the model has {p.num_experts}; every expert needs its A and B"
                )
            A.append(torch.stack([got[e][0] for e in range(p.num_experts)]))
            B.append(torch.stack([got[e][1] for e in range(p.num_experts)]))
        rows = p.part_rows()
        shared_a = all(a.shape == A[0].shape and torch.equal(a, A[0]) for a in A)
        inner = A[0].shape[1] if shared_a else sum(a.shape[1] for a in A)
        b_full = B[0].new_zeros(p.num_experts, p.out_features, inner)
        col = 0
        for (j, part), a, b in zip(present, A, B):
            if b.shape[1] != rows[j].numel() or a.shape[2] != p.in_features:
                raise InputError(
                    f"{module}.*.{part}: A {tuple(a.shape[1:])} / B {tuple(b.shape[1:])} do not fit "
                    f"({rows[j].numel()}, {p.in_features})"
                )
            width = b.shape[2]
            b_full[:, rows[j], col : col + width] = b
            col += 0 if shared_a else width
        out[p.path] = (A[0] if shared_a else torch.cat(A, dim=1), b_full)
    unknown = set(projs) - used
    if unknown:
        raise InputError(
            f"{module}: per-expert projections {sorted(unknown)} are not part of this model's experts "
            f"({', '.join(layout.module_params[module])})"
        )
    return out


@torch.no_grad()
def merge_into(model: nn.Module, adapter: CanonicalAdapter) -> nn.Module:
    """Add every delta into the model's weights in place (as PEFT's merge does: delta cast to the weight dtype).
    Refuses lm_head / embedding LoRA on a model whose lm_head shares the embedding's weight: PEFT keeps them as two
    adapters on one tensor (with ensure_weight_tying too it saves both, tied), which no merge into that tensor is."""
    get_head, get_emb = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_head() if get_head is not None else None
    emb = get_emb() if get_emb is not None else None
    if (
        (adapter.embed or "lm_head" in adapter.dense)
        and head is not None
        and emb is not None
        and head.weight is emb.weight
    ):
        raise InputError(
            "lm_head / embed_tokens LoRA on a model with tied embeddings cannot be merged into the "
            "shared weight; run it unmerged (the hf engine does)"
        )
    for name in [*adapter.dense, *adapter.embed]:
        w = model.get_parameter(f"{name}.weight")
        w.add_(adapter.delta(name).to(w.device, w.dtype))
    for name in adapter.experts:
        w = model.get_parameter(name)
        d = adapter.delta(name)
        if getattr(model.get_submodule(name.rsplit(".", 1)[0]), "is_transposed", False):
            d = d.transpose(1, 2)
        w.add_(d.to(w.device, w.dtype))
    return model
