"""LoRA adapters for MoE models: target groups, a seeded generator, the two on-disk expert layouts and exact
converters between them, the canonical in-memory form that runtimes and metamorphic checks use, and inspection.

Keys PEFT 0.21 writes (transformers 5). Every key is ``base_model.model.`` + the in-memory module path + suffix:
  dense       <module>.lora_A.weight (r, in)           <module>.lora_B.weight (out, r)
  peft3d      <experts>.lora_A.weight (r*E, in)         <experts>.lora_B.weight (out, r*E)
              PEFT wraps each targeted parameter of a module in its own ParamWrapper, the first parameter in the
              module's definition order innermost. With both targeted, gate_up_proj (Nemotron: up_proj) is
              ``<experts>.base_layer.lora_*`` and down_proj is ``<experts>.lora_*``; with one targeted it is
              ``<experts>.lora_*`` whichever it is. Expert e: A_e = A.reshape(E, r, in)[e],
              B_e = B.reshape(out, r, E)[:, :, e]; in/out are the projection's, whatever the parameter's orientation
              (gpt-oss stores (E, in, out), the others (E, out, in)).
  per_expert  <experts>.<e>.gate_proj|up_proj|down_proj.lora_A.weight (r, in), .lora_B.weight (out, r)
              (vLLM / SGLang and transformers-4-era PEFT; Nemotron's non-gated experts have up_proj/down_proj only).
Nemotron-H checkpoints call the decoder ``backbone.`` on disk (``model.`` in memory) and PEFT 0.21 writes
``model.``; readers accept either, writers take ``disk_root``. Qwen3.5 multimodal checkpoints nest the text decoder
under ``model.language_model.``; readers accept that too.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from lpdiff.harness.types import AdapterSpec

GROUPS = ("attention", "linear_attention", "mlp", "shared_expert", "experts")
LAYOUTS = ("peft3d", "per_expert")
PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PROVENANCE_NAME = "lpdiff_adapter.json"  # how lpdiff made this directory (generator recipe, conversions)
GENERATOR_VERSION = "lpdiff-adapter-gen/v1"  # bump when generated values change for the same arguments
DEFAULT_SCALE = 0.2

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}
_ROUTERS = {"gate", "router", "shared_expert_gate"}
_SHARED = {"shared_expert", "shared_experts"}
# PEFT raises for LoRA on these leaves of Mamba models; the linear_attention group leaves them out.
_PEFT_MAMBA_TYPES = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}
_PEFT_MAMBA_REFUSED = {"out_proj", "conv1d"}
_ROOT_ALIASES = {"nemotron_h": ("backbone.",), "qwen3_5_moe_text": ("model.language_model.",),
                 "qwen3_5_moe": ("model.language_model.",)}
# fused expert parameter -> its per-expert projections, in the order their rows appear in the fused output
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
_KEY = re.compile(r"(.+)\.lora_([AB])\.weight")
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)")


def module_group(path: str) -> str:
    """The target group of a module or parameter path (in-memory or on-disk names): one of GROUPS, "router" or
    "other". Name-based, so it works on adapter keys without a model."""
    parts = path.split(".")
    leaf, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if leaf in _ROUTERS:
        return "router"
    if "experts" in parts:
        return "experts"
    if any(p in _SHARED for p in parts):
        return "shared_expert"
    if leaf in _ATTENTION:
        return "attention"
    if parent == "linear_attn" or (parent == "mixer" and leaf in ("in_proj", "out_proj")):
        return "linear_attention"
    if leaf in _MLP:
        return "mlp"
    return "other"


# -- the model's structure -----------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class ExpertParam:
    """One fused 3D expert parameter, described by the module that holds it."""

    path: str  # model.layers.1.mlp.experts.gate_up_proj
    module: str  # model.layers.1.mlp.experts
    name: str  # gate_up_proj
    num_experts: int
    out_features: int
    in_features: int
    transposed: bool  # stored (E, in, out) (gpt-oss) instead of (E, out, in)
    interleaved: bool  # fused gate/up rows alternate (gpt-oss) instead of [gate; up]

    @property
    def parts(self) -> tuple[str, ...]:
        try:
            return _EXPERT_PARTS[self.name]
        except KeyError:
            raise ValueError(f"expert parameter {self.path} has no known per-expert layout (known: "
                             f"{sorted(_EXPERT_PARTS)})") from None

    def part_rows(self) -> list[torch.Tensor]:
        """Row indices (in the fused output) of each per-expert projection."""
        n = len(self.parts)
        rows = torch.arange(self.out_features)
        if n == 1:
            return [rows]
        return list(rows.view(-1, n).T if self.interleaved else rows.view(n, -1))


@dataclass(slots=True)
class ModelLayout:
    """What adapters can target in a model: its nn.Linear modules and fused expert parameters."""

    model_type: str
    linears: dict[str, tuple[int, int]]  # module path -> (out, in)
    experts: dict[str, ExpertParam]  # parameter path -> description
    module_params: dict[str, tuple[str, ...]]  # experts module -> its 3D parameter names, in definition order

    @classmethod
    def of(cls, model: nn.Module) -> "ModelLayout":
        linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        experts, module_params = {}, {}
        for mname, mod in model.named_modules():
            if mname.rsplit(".", 1)[-1] != "experts":
                continue
            names = []
            for pname, p in mod.named_parameters(recurse=False):
                if p.ndim != 3:  # biases (E, out) are not LoRA targets
                    continue
                transposed = bool(getattr(mod, "is_transposed", False))
                e, a, b = p.shape
                out_f, in_f = (b, a) if transposed else (a, b)
                path = f"{mname}.{pname}"
                experts[path] = ExpertParam(path, mname, pname, e, out_f, in_f, transposed,
                                            not bool(getattr(mod, "is_concatenated", True)))
                names.append(pname)
            module_params[mname] = tuple(names)
        return cls(model.config.model_type, linears, experts, module_params)

    @classmethod
    def from_config(cls, config) -> "ModelLayout":
        """Built on the meta device: no memory, no weights, full-size configs are fine."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(config, dict):
            kw = dict(config)
            config = AutoConfig.for_model(kw.pop("model_type"), **kw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        return cls.of(model)

    def per_expert_paths(self) -> list[str]:
        """Expert 0's per-expert module names: names a dense target must not also match (engines read them)."""
        return [f"{p.module}.0.{part}" for p in self.experts.values() for part in p.parts if p.name in _EXPERT_PARTS]

    def memory_path(self, key: str) -> tuple[str, str]:
        """'base_model.model.backbone.layers.1.x.lora_A.weight' -> ('model.layers.1.x', 'A')."""
        if not key.startswith(PEFT_PREFIX):
            raise ValueError(f"tensor {key!r} does not start with {PEFT_PREFIX!r}: not a PEFT LoRA adapter")
        path = key[len(PEFT_PREFIX):]
        for alias in _ROOT_ALIASES.get(self.model_type, ()):
            if path.startswith(alias):
                path = "model." + path[len(alias):]
                break
        m = _KEY.fullmatch(path)
        if m is None:
            raise ValueError(f"tensor {key!r} is not a LoRA A/B weight; lpdiff handles plain LoRA only (no DoRA "
                             "magnitudes, LoRA biases, embedding LoRA or modules_to_save)")
        return m.group(1), m.group(2)


# -- target groups -------------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class Targets:
    modules: tuple[str, ...]  # nn.Linear module paths (through PEFT target_modules)
    params: tuple[str, ...]  # fused expert parameter paths (through PEFT target_parameters)
    target_modules: tuple[str, ...]  # the shortest unambiguous suffixes naming exactly `modules`
    target_parameters: tuple[str, ...]  # same for `params`


def _router_error(target: str) -> ValueError:
    return ValueError(f"adapter target {target!r} is a router/gate: LoRA on the router is not supported by the "
                      "engines (vLLM and SGLang refuse it); drop it and target the experts with group 'experts'")


def resolve_targets(layout: ModelLayout, groups: Sequence[str]) -> Targets:
    """Group names (GROUPS) or module/parameter suffixes (e.g. 'self_attn.q_proj', 'mlp.experts.down_proj') ->
    the exact modules and parameters they name in this model. Raises on routers and on targets matching nothing."""
    if isinstance(groups, str):
        groups = [groups]
    candidates = {**{n: "module" for n in layout.linears}, **{n: "param" for n in layout.experts}}
    present = sorted({module_group(n) for n in candidates} & set(GROUPS))
    mamba = layout.model_type in _PEFT_MAMBA_TYPES
    chosen: set[str] = set()
    for g in groups:
        if module_group(g) == "router":
            raise _router_error(g)
        if g in GROUPS:
            hits = {n for n in candidates if module_group(n) == g}
            if mamba:  # the group means what PEFT accepts: mamba in_proj only
                hits = {n for n in hits if n.rsplit(".", 1)[-1] not in _PEFT_MAMBA_REFUSED}
        else:
            hits = {n for n in candidates if n == g or n.endswith("." + g)}
            if any(module_group(n) == "router" for n in hits):
                raise _router_error(g)
            if mamba and any(n.rsplit(".", 1)[-1] in _PEFT_MAMBA_REFUSED for n in hits):
                raise ValueError(f"adapter target {g!r} names a Mamba {sorted(_PEFT_MAMBA_REFUSED)} module: PEFT "
                                 f"refuses LoRA there on {layout.model_type}; target the mamba in_proj instead")
        if not hits:
            raise ValueError(f"adapter target {g!r} matches nothing in this {layout.model_type} model; groups it "
                             f"has: {present} (or give a module/parameter suffix such as 'self_attn.q_proj')")
        chosen |= hits
    modules = sorted(n for n in chosen if candidates[n] == "module")
    params = sorted(n for n in chosen if candidates[n] == "param")
    return Targets(tuple(modules), tuple(params),
                   tuple(_suffixes(modules, [*layout.linears, *layout.per_expert_paths()])),
                   tuple(_suffixes(params, layout.experts, min_depth=3)))


def _suffixes(chosen: Sequence[str], universe, min_depth: int = 1) -> list[str]:
    """The shortest dotted suffixes that, with PEFT's matching (equal, or ends with '.' + suffix), name exactly
    `chosen` among `universe`: 'q_proj' when every q_proj is chosen, 'shared_expert.gate_proj' when a bare
    'gate_proj' would also name an expert projection."""
    chosen_set, left, out = set(chosen), set(chosen), []
    depth = min_depth
    while left:
        if depth > max(len(n.split(".")) for n in left):
            raise AssertionError(f"no suffix names exactly {sorted(left)[:3]}...")  # a path nested in another
        for suf in sorted({".".join(n.split(".")[-depth:]) for n in left}):
            hits = {u for u in universe if u == suf or u.endswith("." + suf)}
            if hits <= chosen_set:
                out.append(suf)
                left -= hits
        depth += 1
    return out


# -- canonical form ------------------------------------------------------------------------------------------------

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
    fuse exactly into one gate_up entry of inner dimension 2*rank (A stacked, B block-structured); `scaling` is
    the adapter's and applies to every entry.
    """

    rank: int
    alpha: float
    use_rslora: bool
    scaling: float
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A (r, in), B (out, r))
    experts: dict[str, tuple[torch.Tensor, torch.Tensor]]  # param path -> (A (E, r, in), B (E, out, r))
    config: dict[str, Any] = field(default_factory=dict)  # the adapter_config.json it was read from
    layout: str = "peft3d"  # the disk layout it was read from: peft3d | per_expert | dense_only

    def __post_init__(self):
        assert self.scaling == peft_scaling(self.alpha, self.rank, self.use_rslora)
        for name, (a, b) in self.dense.items():
            assert a.ndim == 2 and b.ndim == 2 and a.shape[0] == b.shape[1], f"{name}: A {a.shape} B {b.shape}"
        for name, (a, b) in self.experts.items():
            assert a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2], \
                f"{name}: A {a.shape} B {b.shape}"

    def delta(self, name: str) -> torch.Tensor:
        """scaling * B @ A in (out, in) orientation ((E, out, in) for experts), in fp32."""
        a, b = self.dense[name] if name in self.dense else self.experts[name]
        return self.scaling * (b.float() @ a.float())

    @property
    def inner_dims(self) -> set[int]:
        return {a.shape[-2] for a, _ in [*self.dense.values(), *self.experts.values()]}


def _read_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {CONFIG_NAME}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir} is a {cfg['peft_type']} adapter; lpdiff handles LORA only")
    for flag in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ValueError(f"{adapter_dir}: {flag}=true is not supported (plain LoRA only)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{adapter_dir}: rank_pattern/alpha_pattern give modules different scalings, which the "
                         "canonical form does not carry; re-save the adapter with one rank and alpha")
    return cfg


def peft_signature(adapter_dir: str | Path) -> str:
    """What decides whether PEFT can hold adapters side by side: one PeftModel takes several adapters only when
    they spell ``target_parameters`` the same way (NOTES.md); equal signatures can share one."""
    return f"|{sorted(_read_config(Path(adapter_dir)).get('target_parameters') or [])}"


def _load_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = adapter_dir / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {WEIGHTS_NAME} (lpdiff reads safetensors adapters only)")
    return load_file(str(path))


def _targeted(layout: ModelLayout, module: str, target_parameters) -> list[str]:
    """The module's parameters PEFT wraps for `target_parameters`, innermost first (definition order)."""
    return [p for p in layout.module_params[module]
            if any(f"{module}.{p}" == t or f"{module}.{p}".endswith("." + t) for t in target_parameters or ())]


def _as_layout(model_config) -> ModelLayout:
    return model_config if isinstance(model_config, ModelLayout) else ModelLayout.from_config(model_config)


def load_canonical(adapter_dir: str | Path, model_config) -> CanonicalAdapter:
    """Read an adapter in either disk layout. `model_config`: the base model's transformers config (or a dict,
    or a ModelLayout); it decides which key is which parameter and how fused rows split."""
    adapter_dir = Path(adapter_dir)
    cfg = _read_config(adapter_dir)
    layout = _as_layout(model_config)
    pairs: dict[tuple, dict[str, torch.Tensor]] = {}  # (kind, ...) -> {"A": t, "B": t}
    for key, t in _load_tensors(adapter_dir).items():
        mod, which = layout.memory_path(key)
        base = re.sub(r"(\.base_layer)+$", "", mod)
        depth = (len(mod) - len(base)) // len(".base_layer")
        pe = _PER_EXPERT.fullmatch(mod)
        if base in layout.module_params:
            names = _targeted(layout, base, cfg.get("target_parameters"))
            if depth >= len(names):
                raise ValueError(f"{key}: {len(names)} parameter(s) of {base} are in target_parameters "
                                 f"{cfg.get('target_parameters')}, so PEFT nests at most {len(names) - 1} base_layer")
            ident = ("3d", f"{base}.{names[len(names) - 1 - depth]}")
        elif pe is not None and pe.group(1) in layout.module_params:
            ident = ("pe", pe.group(1), pe.group(3), int(pe.group(2)))
        elif mod in layout.linears:
            ident = ("dense", mod)
        else:
            raise ValueError(f"{key}: no module {mod!r} in this {layout.model_type} model; is the adapter for "
                             "another model (or another depth)?")
        slot = pairs.setdefault(ident, {})
        if which in slot:
            raise ValueError(f"{key}: two tensors map to the same LoRA {which} of {ident[1]}")
        slot[which] = t
    for ident, slot in pairs.items():
        if set(slot) != {"A", "B"}:
            raise ValueError(f"{adapter_dir}: {ident[1]} has lora_{''.join(slot)} but not both A and B")

    dense, experts, per_expert = {}, {}, {}
    for ident, s in pairs.items():
        if ident[0] == "dense":
            out_f, in_f = layout.linears[ident[1]]
            _check_shapes(ident[1], s["A"], s["B"], in_f, out_f)
            dense[ident[1]] = (s["A"], s["B"])
        elif ident[0] == "3d":
            p = layout.experts[ident[1]]
            E = p.num_experts
            a, b = s["A"], s["B"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] % E or b.shape[1] % E:
                raise ValueError(f"{ident[1]}: A {tuple(a.shape)} / B {tuple(b.shape)} are not (r*{E}, in) / "
                                 f"(out, r*{E})")
            a = a.reshape(E, -1, a.shape[-1])
            b = b.reshape(b.shape[0], -1, E).permute(2, 0, 1).contiguous()
            _check_shapes(ident[1], a, b, p.in_features, p.out_features)
            experts[ident[1]] = (a, b)
        else:
            per_expert.setdefault(ident[1], {}).setdefault(ident[2], {})[ident[3]] = (s["A"], s["B"])
    for module, projs in per_expert.items():
        experts.update(_fuse_per_expert(layout, module, projs))

    layout_name = "per_expert" if per_expert else "peft3d" if experts else "dense_only"
    if per_expert and any(ident[0] == "3d" for ident in pairs):
        raise ValueError(f"{adapter_dir} mixes the peft3d and per_expert expert layouts")
    rank, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    return CanonicalAdapter(rank, alpha, rslora, peft_scaling(alpha, rank, rslora), dense, experts, cfg, layout_name)


def _check_shapes(name: str, a: torch.Tensor, b: torch.Tensor, in_f: int, out_f: int) -> None:
    if a.shape[-1] != in_f or b.shape[-2] != out_f or a.shape[-2] != b.shape[-1]:
        raise ValueError(f"{name}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the model's "
                         f"(out={out_f}, in={in_f}); is the adapter for another model size?")


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
        for j, part in present:
            used.add(part)
            got = projs[part]
            if sorted(got) != list(range(p.num_experts)):
                raise ValueError(f"{module}.<e>.{part}: the adapter has {len(got)} experts (indices {min(got)}.."
                                 f"{max(got)}) but the model has {p.num_experts}; every expert needs its A and B")
            A.append(torch.stack([got[e][0] for e in range(p.num_experts)]))
            B.append(torch.stack([got[e][1] for e in range(p.num_experts)]))
        rows = p.part_rows()
        shared_a = all(a.shape == A[0].shape and torch.equal(a, A[0]) for a in A)
        inner = A[0].shape[1] if shared_a else sum(a.shape[1] for a in A)
        b_full = B[0].new_zeros(p.num_experts, p.out_features, inner)
        col = 0
        for (j, part), a, b in zip(present, A, B):
            if b.shape[1] != rows[j].numel() or a.shape[2] != p.in_features:
                raise ValueError(f"{module}.*.{part}: A {tuple(a.shape[1:])} / B {tuple(b.shape[1:])} do not fit "
                                 f"({rows[j].numel()}, {p.in_features})")
            width = b.shape[2]
            b_full[:, rows[j], col:col + width] = b
            col += 0 if shared_a else width
        out[p.path] = (A[0] if shared_a else torch.cat(A, dim=1), b_full)
    unknown = set(projs) - used
    if unknown:
        raise ValueError(f"{module}: per-expert projections {sorted(unknown)} are not part of this model's experts "
                         f"({', '.join(layout.module_params[module])})")
    return out


@torch.no_grad()
def merge_into(model: nn.Module, adapter: CanonicalAdapter) -> nn.Module:
    """Add every delta into the model's weights in place (as PEFT's merge does: delta cast to the weight dtype)."""
    for name in adapter.dense:
        w = model.get_submodule(name).weight
        w += adapter.delta(name).to(w.device, w.dtype)
    for name in adapter.experts:
        w = model.get_parameter(name)
        d = adapter.delta(name)
        if getattr(model.get_submodule(name.rsplit(".", 1)[0]), "is_transposed", False):
            d = d.transpose(1, 2)
        w += d.to(w.device, w.dtype)
    return model


# -- writing -------------------------------------------------------------------------------------------------------

def _rerank(adapter: CanonicalAdapter) -> tuple[int, float]:
    """One rank for every entry (engines take one per adapter): the largest inner dimension, with alpha chosen so
    the scaling stays bit-identical. Refuses when no alpha gives exactly the same scaling."""
    new_rank = max(adapter.inner_dims | {adapter.rank})
    if new_rank == adapter.rank:
        return adapter.rank, adapter.alpha
    ratio = new_rank / adapter.rank
    alpha = adapter.alpha * (math.sqrt(ratio) if adapter.use_rslora else ratio)
    if peft_scaling(alpha, new_rank, adapter.use_rslora) != adapter.scaling:
        raise ValueError(f"this adapter needs rank {new_rank} (from {adapter.rank}) in one file, but no lora_alpha "
                         f"gives exactly the same scaling {adapter.scaling!r}{' with rslora' if adapter.use_rslora else ''}"
                         "; refusing to approximate. Use the source adapter as it is.")
    return new_rank, alpha


def _pad(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows of A and zero columns of B up to `rank`: B @ A is unchanged exactly."""
    extra = rank - a.shape[-2]
    if extra == 0:
        return a, b
    a_pad = torch.cat([a, a.new_zeros(*a.shape[:-2], extra, a.shape[-1])], dim=-2)
    b_pad = torch.cat([b, b.new_zeros(*b.shape[:-1], extra)], dim=-1)
    return a_pad, b_pad


def save_canonical(adapter: CanonicalAdapter, out_dir: str | Path, model_config, layout: str = "peft3d",
                   disk_root: str | None = None, provenance: dict | None = None) -> dict[str, Any]:
    """Write a canonical adapter as a PEFT-format directory in `layout`. Entries of different inner dimensions
    are zero-padded to one rank with alpha adjusted (exactly; see _rerank). `disk_root`: write the decoder under
    this name instead of ``model`` (e.g. "backbone" for Nemotron-H's on-disk names). Returns the written config."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    mlayout = _as_layout(model_config)
    rank, alpha = _rerank(adapter)
    root = "model." if disk_root is None else disk_root.rstrip(".") + "."

    def key(path: str, which: str) -> str:
        assert path.startswith("model."), path
        return f"{PEFT_PREFIX}{root}{path[len('model.'):]}.lora_{which}.weight"

    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b) in adapter.dense.items():
        a, b = _pad(a, b, rank)
        tensors[key(name, "A")], tensors[key(name, "B")] = a, b
    expert_names: set[str] = set()
    target_parameters: list[str] = []
    for name, (a, b) in adapter.experts.items():
        p = mlayout.experts[name]
        a, b = _pad(a, b, rank)
        if layout == "peft3d":
            names = [n for n in mlayout.module_params[p.module] if f"{p.module}.{n}" in adapter.experts]
            nest = ".base_layer" * (len(names) - 1 - names.index(p.name))
            tensors[key(p.module + nest, "A")] = a.reshape(-1, a.shape[-1])
            tensors[key(p.module + nest, "B")] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
            target_parameters.append(name)
        else:
            for part, rows in zip(p.parts, p.part_rows()):
                expert_names.add(part)
                for e in range(p.num_experts):
                    tensors[key(f"{p.module}.{e}.{part}", "A")] = a[e].clone()  # gate and up share A
                    tensors[key(f"{p.module}.{e}.{part}", "B")] = b[e, rows]

    cfg = dict(adapter.config)
    cfg.update(r=rank, lora_alpha=alpha, rank_pattern={}, alpha_pattern={}, peft_type="LORA")
    dense = sorted(adapter.dense)
    cfg["target_modules"] = sorted(set(_suffixes(dense, [*mlayout.linears, *mlayout.per_expert_paths()]))
                                   | expert_names)
    cfg["target_parameters"] = _suffixes(sorted(target_parameters), mlayout.experts, min_depth=3) or None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    _write_json(out_dir / CONFIG_NAME, cfg)
    if provenance is not None:
        _write_json(out_dir / PROVENANCE_NAME, provenance)
    return cfg


def _write_json(path: Path, obj: dict) -> None:
    """Byte-stable JSON: adapter directories are content-hashed into baseline keys. PEFT saves target_modules
    from a set, whose order changes with PYTHONHASHSEED, so target lists are sorted too."""
    obj = dict(obj)
    if "peft_type" in obj:
        # Loading never needs random init: every LoRA tensor is in the file. With False, PEFT would give random
        # weights to modules the targets also match but the file does not cover (per-expert gate/up/down names
        # also match Qwen3.5's shared expert and Nemotron's dense MLP), silently adding a random adapter.
        obj["init_lora_weights"] = True
    for k in ("target_modules", "target_parameters"):
        if isinstance(obj.get(k), (list, tuple, set)):
            obj[k] = sorted(obj[k])
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _read_provenance(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / PROVENANCE_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


def convert_adapter(src_dir: str | Path, dst_dir: str | Path, to: str, model_config,
                    disk_root: str | None = None) -> AdapterSpec:
    """Convert between the peft3d and per_expert layouts (dense entries are copied). Exact both ways:
    per_expert -> peft3d stays at rank r when gate and up share A in every expert, and otherwise stacks to rank 2r
    (block-structured B, alpha doubled so the scaling is identical); the rank change is recorded in
    lpdiff_adapter.json. Refuses (clear error) where exactness is impossible (rslora with a rank change)."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if src_dir.resolve() == dst_dir.resolve():
        raise ValueError("convert_adapter writes a new directory; give a dst_dir other than src_dir")
    adapter = load_canonical(src_dir, model_config)
    prov = _read_provenance(src_dir)
    cfg = save_canonical(adapter, dst_dir, model_config, to, disk_root)
    step = {"from": adapter.layout, "to": to, "rank": [adapter.rank, cfg["r"]],
            "alpha": [adapter.alpha, cfg["lora_alpha"]], "disk_root": disk_root or "model"}
    if cfg["r"] != adapter.rank:
        step["why"] = ("per-expert gate and up have different A matrices; fused exactly by stacking A and "
                       "block-structured B, other entries zero-padded")
    prov["conversions"] = [*prov.get("conversions", []), step]
    _write_json(dst_dir / PROVENANCE_NAME, prov)
    return AdapterSpec(name=dst_dir.name, path=str(dst_dir))


# -- generator -----------------------------------------------------------------------------------------------------

def _generator(seed: int, *parts: str) -> torch.Generator:
    """A CPU generator per tensor: values depend on (seed, tensor name) only, not on which other groups exist."""
    digest = hashlib.sha256("/".join([str(seed), *parts]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def generate_adapter(model: nn.Module, out_dir: str | Path, groups: Sequence[str] = ("attention", "experts"),
                     rank: int = 8, alpha: float = 16, seed: int = 0, scale: float = DEFAULT_SCALE,
                     layout: str = "peft3d", shared_outer: bool = False, use_rslora: bool = False,
                     dtype: torch.dtype = torch.float32) -> AdapterSpec:
    """A deterministic random LoRA adapter for `model` (a transformers model with real weights), saved by PEFT's
    own save_pretrained (peft3d) or converted from it (per_expert).

    Every A and B is non-zero. Sizes: A ~ N(0, 1/in), B ~ N(0, c^2) with c chosen so that the RMS of each
    delta scaling * B @ A is `scale` times the RMS of the weight it adapts. The default 0.2 moves the tiny zoo's
    actual-token logprobs by mean |d| 0.17-0.28 (max 1.0-2.5) with every group, 0.07-0.13 (max 0.5-1.0) with
    experts only (docs/zoo.md, "Generated adapter scale"). `shared_outer`: A of gate_up (Nemotron: up) and B of down_proj identical
    across experts (the layout some engines use). The caller's model is not modified: PEFT wraps a meta-device
    copy of it."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if getattr(model, "peft_config", None) is not None:
        raise ValueError("pass the base transformers model, not a PeftModel")
    assert rank >= 1 and scale > 0
    mlayout = ModelLayout.of(model)
    targets = resolve_targets(mlayout, groups)
    lcfg = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=use_rslora, init_lora_weights=False,
                      # [] and not None: PEFT fills None with its default targets for some model types
                      # (nemotron_h: q/k/v/o_proj), even when target_parameters are given
                      target_modules=list(targets.target_modules),
                      target_parameters=list(targets.target_parameters) or None,
                      base_model_name_or_path=getattr(model, "name_or_path", None) or None)
    with torch.device("meta"):
        shadow = type(model)._from_config(copy.deepcopy(model.config), dtype=torch.float32)
        peft_model = get_peft_model(shadow, lcfg)
    tuner = peft_model.base_model
    got_modules, got_params = set(tuner.targeted_module_names), set(tuner.targeted_parameter_names)
    if got_modules != set(targets.modules) or got_params != set(targets.params):
        diff = sorted((got_modules | got_params) ^ set(targets.modules + targets.params))[:4]
        raise ValueError(f"PEFT did not target exactly what groups {list(groups)} name on this "
                         f"{mlayout.model_type} model (differences: {diff}); PEFT rewrites gate/up/down_proj "
                         "targets to the experts on qwen2-style MoE models: drop the 'mlp'/'shared_expert' group")

    for name, layer in tuner.model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base = re.sub(r"(\.base_layer)+$", "", name)
        pname = getattr(layer, "parameter_name", "weight")
        weight = model.get_parameter(f"{base}.{pname}")
        if weight.is_meta:
            raise ValueError("generate_adapter sizes the adapter from the model's weights; load real weights first")
        a_mod, b_mod = layer.lora_A["default"], layer.lora_B["default"]
        n_exp = getattr(layer, "num_experts", 1)
        r, (out_f, in_f) = layer.r["default"], (b_mod.weight.shape[0], a_mod.weight.shape[1])
        w_rms = torch.linalg.vector_norm(weight.detach(), dtype=torch.float32).item() / math.sqrt(weight.numel())
        if w_rms == 0:
            raise ValueError(f"{base}.{pname} is all zeros: cannot size a relative delta for it")
        b_std = scale * w_rms * math.sqrt(in_f) / (layer.scaling["default"] * math.sqrt(r))
        share_a = shared_outer and n_exp > 1 and pname != "down_proj"
        share_b = shared_outer and n_exp > 1 and pname == "down_proj"
        a = torch.randn(1 if share_a else n_exp, r, in_f, generator=_generator(seed, base, pname, "A"))
        b = torch.randn(out_f, r, 1 if share_b else n_exp, generator=_generator(seed, base, pname, "B"))
        a = (a / math.sqrt(in_f)).expand(n_exp, r, in_f).reshape(n_exp * r, in_f)
        b = (b * b_std).expand(out_f, r, n_exp).reshape(out_f, r * n_exp)
        a_mod.weight = nn.Parameter(a.to(dtype).contiguous(), requires_grad=False)
        b_mod.weight = nn.Parameter(b.to(dtype).contiguous(), requires_grad=False)

    out_dir = Path(out_dir)
    recipe = {"generator": GENERATOR_VERSION, "model_type": mlayout.model_type, "groups": list(groups),
              "rank": rank, "alpha": alpha, "seed": seed, "scale": scale, "shared_outer": shared_outer,
              "use_rslora": use_rslora, "dtype": str(dtype).removeprefix("torch."), "layout": layout}
    with tempfile.TemporaryDirectory() as tmp:
        save_dir = out_dir if layout == "peft3d" else Path(tmp)
        peft_model.save_pretrained(str(save_dir))
        _write_json(save_dir / CONFIG_NAME, json.loads((save_dir / CONFIG_NAME).read_text()))
        _write_json(save_dir / PROVENANCE_NAME, {"generated": recipe})
        if layout == "per_expert":
            convert_adapter(save_dir, out_dir, "per_expert", mlayout)
    return AdapterSpec(name=out_dir.name, path=str(out_dir))


# -- inspection ----------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class AdapterInfo:
    """What an adapter directory holds, read without a model (for `lpdiff doctor`)."""

    path: str
    rank: int
    alpha: float
    rslora: bool
    target_modules: list[str] | str | None
    target_parameters: list[str] | None
    base_model_name_or_path: str | None
    layout: str  # "peft3d" | "per_expert" | "dense_only"
    keys: list[str]  # tensor keys, sorted
    shapes: dict[str, tuple[int, ...]]
    dtypes: list[str]  # tensor dtypes present
    groups: list[str]  # module groups present (GROUPS, plus "router"/"other" when an adapter has them)
    num_experts: int | None  # per_expert: experts seen; peft3d: rows of A / r
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)  # lpdiff_adapter.json, when lpdiff made it


def inspect_adapter(adapter_dir: str | Path) -> AdapterInfo:
    from safetensors import safe_open

    adapter_dir = Path(adapter_dir)
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {CONFIG_NAME}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    weights = adapter_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {WEIGHTS_NAME} (lpdiff reads safetensors adapters only)")
    shapes, dtypes = {}, set()
    with safe_open(str(weights), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            shapes[k] = tuple(sl.get_shape())
            dtypes.add(sl.get_dtype())
    keys = sorted(shapes)
    groups, experts_seen, three_d, rank = set(), set(), [], int(cfg.get("r", 0))
    for k in keys:
        m = _KEY.fullmatch(k)
        mod = m.group(1) if m else k
        groups.add(module_group(mod))
        pe = _PER_EXPERT.fullmatch(mod)
        if pe:
            experts_seen.add(int(pe.group(2)))
        elif re.search(r"\.experts(\.base_layer)*$", mod):
            three_d.append(k)
    if experts_seen and three_d:
        raise ValueError(f"{adapter_dir} mixes the peft3d and per_expert expert layouts")
    layout = "per_expert" if experts_seen else "peft3d" if three_d else "dense_only"
    num_experts = None
    if experts_seen:
        num_experts = max(experts_seen) + 1
    elif three_d and rank:
        a_key = next(k for k in three_d if k.endswith("lora_A.weight"))
        num_experts = shapes[a_key][0] // rank
    return AdapterInfo(
        path=str(adapter_dir), rank=rank, alpha=float(cfg.get("lora_alpha", 0)),
        rslora=bool(cfg.get("use_rslora", False)), target_modules=cfg.get("target_modules"),
        target_parameters=cfg.get("target_parameters"), base_model_name_or_path=cfg.get("base_model_name_or_path"),
        layout=layout, keys=keys, shapes=shapes, dtypes=sorted(dtypes), groups=sorted(groups),
        num_experts=num_experts, rank_pattern=dict(cfg.get("rank_pattern") or {}),
        alpha_pattern=dict(cfg.get("alpha_pattern") or {}), provenance=_read_provenance(adapter_dir))
