"""What a model lets an adapter target: its nn.Linear modules and fused 3D expert parameters, the module group of
every path (name-based, so it works on adapter keys without a model), and group names resolved to exact targets."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lpdiff.harness.spec.errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Module groups an adapter can target, one per kind of block of the four families: full attention (Qwen3.5's
# q_proj is twice as wide: query and output gate), Gated DeltaNet linear attention (Qwen3.5: in_proj_qkv, in_proj_z,
# in_proj_b, in_proj_a, out_proj), Mamba-2 mixers (Nemotron-H: in_proj, out_proj), dense MLPs, shared experts and
# routed experts. A verdict names the group whose LoRA an engine mishandles by these names.
GROUPS = (
    "attention",
    "linear_attention",
    "mamba",
    "mlp",
    "shared_expert",
    "experts",
    "latent",
    "lm_head",
    "embed_tokens",
)
# the vocabulary-sized groups (PEFT adapts both: lm_head as a Linear LoRA, the input embedding as an Embedding LoRA
# whose tensors are lora_embedding_A (r, vocab) and lora_embedding_B (hidden, r)). A model's "all" adapters leave
# them out: trainers add them on purpose (new tokens, a tuned head), and the committed zoo predates them
VOCAB_GROUPS = ("lm_head", "embed_tokens")
LAYOUTS = ("peft3d", "per_expert", "per_expert_gate")
# per_expert_gate: per_expert with a non-gated expert's input projection saved as experts.{e}.gate_proj, the name
# SGLang reads it under (its non-gated MoE buffer takes gate_proj as the unstacked gate_up, lora/lora.py:370); on
# gated experts it is per_expert
NONGATED_INPUT = ("up_proj", "gate_proj")  # (model's part name, per_expert_gate's name)
PEFT_PREFIX = "base_model.model."

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}
_ROUTERS = {"gate", "router", "shared_expert_gate"}
_SHARED = {"shared_expert", "shared_experts"}
_LATENT = {"fc1_latent_proj", "fc2_latent_proj"}
_EMBED = {"embed_tokens", "embeddings"}  # Nemotron-H: backbone.embeddings
# PEFT 0.21 raises for LoRA on these leaves of Mamba models (peft/tuners/tuners_utils.py,
# _check_lora_target_modules_mamba): the mamba group is in_proj alone there.
_PEFT_MAMBA_TYPES = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}
_PEFT_MAMBA_REFUSED = {"out_proj", "conv1d"}
_ROOT_ALIASES = {
    "nemotron_h": ("backbone.",),
    "qwen3_5_moe_text": ("model.language_model.",),
    "qwen3_5_moe": ("model.language_model.",),
}
# fused expert parameter -> its per-expert projections, in the order their rows appear in the fused output
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
KEY_RE = re.compile(r"(.+)\.lora_([AB])\.weight")
EMBED_KEY_RE = re.compile(r"(.+)\.lora_embedding_([AB])")  # PEFT's Embedding LoRA: parameters, no ".weight"
PER_EXPERT_RE = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)")


def key_module(key: str) -> tuple[str, str] | None:
    """A LoRA tensor key -> (module path as written, "A" or "B"), for Linear and Embedding LoRA alike; None for
    anything else (DoRA magnitudes, biases, saved base layers)."""
    m = KEY_RE.fullmatch(key) or EMBED_KEY_RE.fullmatch(key)
    return (m.group(1), m.group(2)) if m else None


def pattern_value(patterns: dict | None, path: str):
    """The value of the first key of a rank_pattern / alpha_pattern that names ``path``, as PEFT 0.21 matches them
    (utils/other.py get_pattern_key: the key is a regex for a dotted suffix of the module path); None if none."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return None


def disk_roots(model_type: str) -> tuple[str, ...]:
    """The decoder roots an adapter of this model may name on disk (``model``, or its checkpoint's own): readers
    accept each, writers take one as ``disk_root``."""
    return ("model", *(a.rstrip(".") for a in _ROOT_ALIASES.get(model_type, ())))


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
    if parent == "linear_attn":
        return "linear_attention"
    if parent in ("mixer", "mamba") and leaf in ("in_proj", "out_proj"):  # Nemotron-H / Mamba-2, Falcon-H1
        return "mamba"
    if leaf == "lm_head":
        return "lm_head"
    if leaf in _EMBED:
        return "embed_tokens"
    if leaf in _LATENT:  # latent MoE (Nemotron-3-Super): hidden -> latent before the experts, latent -> hidden after
        return "latent"
    if leaf in _MLP:
        return "mlp"
    return "other"


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
            return EXPERT_PARTS[self.name]
        except KeyError:
            raise InputError(
                f"expert parameter {self.path} has no known per-expert layout (known: {sorted(EXPERT_PARTS)})"
            ) from None

    def disk_parts(self, layout: str = "per_expert") -> tuple[str, ...]:
        """The per-expert module names its parts are saved under in ``layout``."""
        if layout == "per_expert_gate" and self.parts == NONGATED_INPUT[:1]:
            return NONGATED_INPUT[1:]
        return self.parts

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
    embeddings: dict[str, tuple[int, int]] = field(default_factory=dict)  # nn.Embedding path -> (vocab, hidden)

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelLayout:
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
                experts[path] = ExpertParam(
                    path, mname, pname, e, out_f, in_f, transposed, not bool(getattr(mod, "is_concatenated", True))
                )
                names.append(pname)
            module_params[mname] = tuple(names)
        embeddings = {
            n: (m.num_embeddings, m.embedding_dim) for n, m in model.named_modules() if isinstance(m, nn.Embedding)
        }
        return cls(model.config.model_type, linears, experts, module_params, embeddings)

    @classmethod
    def from_config(cls, config) -> ModelLayout:
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
        return [f"{p.module}.0.{part}" for p in self.experts.values() for part in p.parts if p.name in EXPERT_PARTS]

    def memory_path(self, key: str) -> tuple[str, str]:
        """'base_model.model.backbone.layers.1.x.lora_A.weight' -> ('model.layers.1.x', 'A')."""
        if not key.startswith(PEFT_PREFIX):
            raise InputError(f"tensor {key!r} does not start with {PEFT_PREFIX!r}: not a PEFT LoRA adapter")
        path = key[len(PEFT_PREFIX) :]
        for alias in _ROOT_ALIASES.get(self.model_type, ()):
            if path.startswith(alias):
                path = "model." + path[len(alias) :]
                break
        got = key_module(path)
        if got is None:
            raise InputError(
                f"tensor {key!r} is not a LoRA A/B weight; lpdiff handles plain LoRA only (no DoRA "
                "magnitudes, LoRA biases, saved base layers or modules_to_save)"
            )
        return got

    def targeted_params(self, module: str, target_parameters) -> list[str]:
        """The experts module's parameters PEFT wraps for ``target_parameters``, innermost first (definition
        order)."""
        return [
            p
            for p in self.module_params[module]
            if any(f"{module}.{p}" == t or f"{module}.{p}".endswith("." + t) for t in target_parameters or ())
        ]

    def tensor_slot(self, mod: str, target_parameters) -> tuple:
        """Which weight the LoRA tensors of in-memory module path ``mod`` (memory_path's first part) adapt:
        ("3d", parameter path) for PEFT's stacked experts, whose ``.base_layer`` depth picks the parameter;
        ("pe", experts module, projection, expert) for per-expert files; ("dense", module) for an nn.Linear.
        Raises ValueError naming the problem otherwise."""
        base = re.sub(r"(\.base_layer)+$", "", mod)
        if base in self.module_params:
            depth = (len(mod) - len(base)) // len(".base_layer")
            names = self.targeted_params(base, target_parameters)
            if depth >= len(names):
                raise InputError(
                    f"{len(names)} parameter(s) of {base} are in target_parameters "
                    f"{target_parameters}, so PEFT nests at most {max(len(names) - 1, 0)} base_layer"
                )
            return "3d", f"{base}.{names[len(names) - 1 - depth]}"
        pe = PER_EXPERT_RE.fullmatch(mod)
        if pe is not None and pe.group(1) in self.module_params:
            module, proj = pe.group(1), pe.group(3)
            parts = {part for n in self.module_params[module] for part in self.experts[f"{module}.{n}"].parts}
            if proj == NONGATED_INPUT[1] and proj not in parts and NONGATED_INPUT[0] in parts:
                proj = NONGATED_INPUT[0]  # per_expert_gate's name for a non-gated expert's input
            return "pe", module, proj, int(pe.group(2))
        if mod in self.linears:
            return "dense", mod
        raise InputError(
            f"no module {mod!r} in this {self.model_type} model; is the adapter for another model (or another depth)?"
        )


@dataclass(slots=True, frozen=True)
class Targets:
    modules: tuple[str, ...]  # nn.Linear module paths (through PEFT target_modules)
    params: tuple[str, ...]  # fused expert parameter paths (through PEFT target_parameters)
    target_modules: tuple[str, ...]  # the shortest unambiguous suffixes naming exactly `modules`
    target_parameters: tuple[str, ...]  # same for `params`


def _router_error(target: str) -> ValueError:
    return ValueError(
        f"adapter target {target!r} is a router/gate: LoRA on the router is not supported by the "
        "engines (vLLM and SGLang refuse it); drop it and target the experts with group 'experts'"
    )


def resolve_targets(layout: ModelLayout, groups: Sequence[str]) -> Targets:
    """Group names (GROUPS) or module/parameter suffixes (e.g. 'self_attn.q_proj', 'mlp.experts.down_proj') ->
    the exact modules and parameters they name in this model. Raises on routers and on targets matching nothing."""
    if isinstance(groups, str):
        groups = [groups]
    candidates = {
        **dict.fromkeys([*layout.linears, *layout.embeddings], "module"),
        **dict.fromkeys(layout.experts, "param"),
    }
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
                raise InputError(
                    f"adapter target {g!r} names a Mamba {sorted(_PEFT_MAMBA_REFUSED)} module: PEFT "
                    f"refuses LoRA there on {layout.model_type}; target the mamba in_proj instead"
                )
        if not hits:
            raise InputError(
                f"adapter target {g!r} matches nothing in this {layout.model_type} model; groups it "
                f"has: {present} (or give a module/parameter suffix such as 'self_attn.q_proj')"
            )
        chosen |= hits
    modules = sorted(n for n in chosen if candidates[n] == "module")
    params = sorted(n for n in chosen if candidates[n] == "param")
    return Targets(
        tuple(modules),
        tuple(params),
        tuple(suffixes(modules, [*layout.linears, *layout.embeddings, *layout.per_expert_paths()])),
        tuple(suffixes(params, layout.experts, min_depth=3)),
    )


def suffixes(chosen: Sequence[str], universe, min_depth: int = 1) -> list[str]:
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
