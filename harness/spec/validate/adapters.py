"""Adapter directories checked against the model before any engine loads them (``lpdiff doctor`` reports the
same problems).

Files that cannot be read at all (no directory, broken JSON, a pickle instead of safetensors) raise
``ValidationError`` at once; what the files hold is returned as ``Problem``s: tensors for modules the model lacks,
shapes or ranks that differ from the model or from ``r``, NaN/Inf, targets with no tensors, an adapter made for
another architecture, router LoRA for an engine that refuses it.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lpdiff.harness.spec.adapters.files import CONFIG_NAME, WEIGHTS_NAME, read_provenance
from lpdiff.harness.spec.adapters.layout import ModelLayout
from lpdiff.harness.spec.validate.errors import Problem, ValidationError, first_error

PICKLE_NAMES = ("adapter_model.bin", "pytorch_model.bin")
_ROUTER_LEAVES = ("gate", "router")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_CACHE_SIZE = 16  # models / adapter checks kept per process (a handful of models, a dozen adapters per session)


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What adapters are checked against, read from the model built on the meta device (no weights)."""

    key: str  # the transformers config as JSON: one entry per model config
    meta: Any  # the meta-device model (PEFT injection in doctor)
    layout: ModelLayout
    modules: dict[str, str]  # module path -> class name
    params: frozenset[str]
    routers: frozenset[str]  # router module paths: a 'gate'/'router' beside an 'experts' module

    @property
    def arch(self) -> str:
        return self.layout.model_type


_MODELS: dict[str, ModelFacts] = {}
_CHECKED: dict[tuple, list[Problem]] = {}


def _remember(cache: dict, key, make):
    if key not in cache:
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return cache[key]


def model_facts(spec) -> ModelFacts:
    """Built once per model config (a ModelSpec; ``spec.num_layers`` applied)."""
    from lpdiff.harness.spec.catalog import hf_config

    config = hf_config(spec)
    key = config.to_json_string()

    def make() -> ModelFacts:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        modules = {n: type(m).__name__ for n, m in meta.named_modules() if n}
        routers = {
            n for n in modules if n.rsplit(".", 1)[-1] in _ROUTER_LEAVES and n.rsplit(".", 1)[0] + ".experts" in modules
        }
        return ModelFacts(
            key,
            meta,
            ModelLayout.of(meta),
            modules,
            frozenset(n for n, _ in meta.named_parameters()),
            frozenset(routers),
        )

    return _remember(_MODELS, key, make)


# -- files ----------------------------------------------------------------------------------------------------------


def read_adapter_config(adapter_dir: str | Path, arg: str = "adapter") -> dict[str, Any]:
    """adapter_config.json, parsed, of a directory that also holds safetensors weights; anything else is a
    ValidationError naming the file and the fix. Pickle weights are refused without being opened."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise ValidationError(
            f"{arg} {d}: no such directory; give a PEFT adapter directory ({CONFIG_NAME} + {WEIGHTS_NAME})"
        )
    path = d / CONFIG_NAME
    if not path.is_file():
        raise ValidationError(
            f"{arg} {d}: no {CONFIG_NAME}, so not a PEFT adapter directory; save the adapter with "
            "PEFT's save_pretrained"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValidationError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the file "
            "or re-save the adapter with PEFT's save_pretrained"
        ) from None
    except UnicodeDecodeError:
        raise ValidationError(f"{path}: not UTF-8 text; re-save the adapter with PEFT's save_pretrained") from None
    if not isinstance(cfg, dict):
        raise ValidationError(
            f"{path}: holds a JSON {type(cfg).__name__}, not an object; re-save the adapter with PEFT's save_pretrained"
        )
    if not (d / WEIGHTS_NAME).is_file():
        pickled = [d / n for n in PICKLE_NAMES if (d / n).is_file()]
        if pickled:
            raise ValidationError(
                f"{pickled[0]}: pickle weights; lpdiff never unpickles: save the adapter as "
                f"safetensors (save_pretrained(..., safe_serialization=True) writes {WEIGHTS_NAME})"
            )
        raise ValidationError(f"{arg} {d}: no {WEIGHTS_NAME}; save the adapter's weights as safetensors")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValidationError(
            f"{path}: r is {r!r}, not a positive integer; set r to the rank of the adapter's lora_A tensors"
        )
    return cfg


def read_tensors(adapter_dir: str | Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(adapter_dir) / WEIGHTS_NAME
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValidationError(f"{path}: not a readable safetensors file ({msg}); re-save the adapter") from None


# -- what the files hold ----------------------------------------------------------------------------------------------


def _arch_problem(d: Path, cfg: dict, facts: ModelFacts) -> Problem | None:
    """The architecture the adapter's own files name (PEFT's auto_mapping, lpdiff's generator record)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ours = {type(facts.meta).__name__, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(facts.arch, "?")}
    mapping = cfg.get("auto_mapping")
    said = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    made_for = (read_provenance(d).get("generated") or {}).get("model_type")
    if said and said not in ours:
        what = f"{CONFIG_NAME} says it was made for {said} (auto_mapping.base_model_class)"
    elif made_for and made_for.removesuffix("_text") != facts.arch.removesuffix("_text"):
        what = f"lpdiff_adapter.json says it was generated for a {made_for} model"
    else:
        return None
    return Problem(
        "arch-mismatch",
        f"adapter {d}: {what}, but the model is {facts.arch} ({type(facts.meta).__name__})",
        "use an adapter trained for this model",
    )


def _rank_for(cfg: dict, module: str) -> set[int]:
    """The ranks PEFT gives this module: r, or a rank_pattern entry that names it."""
    for pattern, r in (cfg.get("rank_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return {int(r)}
    return {int(cfg["r"])}


def _expected(key: str, mod: str, cfg: dict, facts: ModelFacts) -> tuple[str, tuple | None]:
    """-> (kind, expected (A shape, B shape) with -1 for the rank) for one tensor's module. kind: 'lora' (checked),
    'router' (a router module), 'other' (a module that exists, left to PEFT), 'missing', or a problem text. Which
    weight a tensor adapts is the layout's answer (ModelLayout.tensor_slot), as for loading."""
    layout = facts.layout
    base = re.sub(r"(\.base_layer)+$", "", mod)
    try:
        slot = layout.tensor_slot(mod, cfg.get("target_parameters"))
    except ValueError as e:
        if base in layout.module_params:  # stacked experts nested deeper than target_parameters allows
            return f"{key}: {e}", None
        if base in facts.routers:
            return "router", None
        return ("other" if base in facts.modules else "missing"), None
    if slot[0] == "3d":
        p = layout.experts[slot[1]]
        return "experts", ((p.num_experts, p.in_features), (p.out_features, p.num_experts))
    if slot[0] == "pe":
        _, module, proj, expert = slot
        for p in (layout.experts[f"{module}.{n}"] for n in layout.module_params[module]):
            if proj in p.parts:
                if expert >= p.num_experts:
                    return f"{key}: expert {expert} of a model with {p.num_experts} experts", None
                return "lora", ((1, p.in_features), (p.part_rows()[p.parts.index(proj)].numel(), 1))
        return f"{key}: {proj} is not a per-expert projection of {module}", None
    out_f, in_f = layout.linears[slot[1]]
    return "lora", ((1, in_f), (out_f, 1))


def tensor_problems(
    d: Path,
    cfg: dict,
    tensors: dict,
    facts: ModelFacts,
    num_layers: int | None = None,
    router_lora: str | None = None,
    engine: str | None = None,
) -> list[Problem]:
    import torch

    found: dict[str, list[str]] = {}
    for key, t in tensors.items():
        try:
            mod, which = facts.layout.memory_path(key)
        except ValueError:
            continue  # DoRA magnitudes, biases, modules_to_save: doctor's not-plain-lora
        layer = _LAYER.search(mod + ".")
        if num_layers is not None and layer and int(layer.group(1)) >= num_layers:
            continue  # a depth-cut model: every engine leaves the deeper layers' tensors out
        if not torch.isfinite(t).all():
            found.setdefault("non-finite", []).append(key)
        kind, shapes = _expected(key, mod, cfg, facts)
        if kind == "router" and router_lora == "refused":
            found.setdefault("router-target", []).append(mod)
        if kind == "missing":
            found.setdefault("tensors-for-missing-modules", []).append(mod)
        elif kind not in ("lora", "experts", "router", "other"):
            found.setdefault("shape-mismatch", []).append(kind)
        if shapes is None:
            continue
        base = re.sub(r"(\.base_layer)+$", "", mod)  # PEFT matches 3D experts' patterns by parameter path
        ranks = set().union(
            *(_rank_for(cfg, p) for p in [base, *(f"{base}.{q}" for q in facts.layout.module_params.get(base, ()))])
        )
        n = shapes[0][0] if kind == "experts" else 1  # peft3d: A is (r * experts, in), B (out, r * experts)
        want = shapes[0][1] if which == "A" else shapes[1][0]
        got = t.shape[1] if which == "A" else t.shape[0] if t.ndim == 2 else None
        if t.ndim != 2 or got != want:
            found.setdefault("shape-mismatch", []).append(
                f"{key} is {tuple(t.shape)}, the model's {mod} needs "
                + (f"(r, {want})" if which == "A" else f"({want}, r)")
                + (f" x {n} experts" if n > 1 else "")
            )
            continue
        rank = t.shape[0] if which == "A" else t.shape[1]
        if rank % n or rank // n not in ranks:
            found.setdefault("rank-mismatch", []).append(
                f"{key} has rank {rank // n if rank % n == 0 else rank / n} but {CONFIG_NAME} says r={min(ranks)}"
            )
    out = [_problem(code, items, d, facts, engine) for code, items in found.items()]
    return out + target_problems(d, cfg, tensors, facts, router_lora, engine)


_MESSAGES = {
    "non-finite": (
        "adapter {d}: {n} tensor(s) hold NaN or Inf (e.g. {first})",
        "re-export the adapter from a checkpoint without NaN/Inf (did training diverge?)",
    ),
    "router-target": (
        "adapter {d}: LoRA on the MoE router ({first}), which the {engine} engine refuses",
        "drop the router from target_modules/target_parameters; adapt the experts instead",
    ),
    "tensors-for-missing-modules": (
        "adapter {d}: {n} tensor(s) are for modules this {arch} model lacks (e.g. {first})",
        "use an adapter made for this model (and depth)",
    ),
    "shape-mismatch": (
        "adapter {d}: {n} tensor(s) do not fit this {arch} model ({first})",
        "use an adapter made for this model size",
    ),
    "rank-mismatch": (
        "adapter {d}: {n} tensor(s) disagree with the config's rank ({first})",
        f"set r (and rank_pattern) in {CONFIG_NAME} to the tensors' rank, or re-save the adapter",
    ),
}


def _problem(code: str, items: list[str], d: Path, facts: ModelFacts, engine: str | None) -> Problem:
    items = sorted(dict.fromkeys(items))
    what, fix = _MESSAGES[code]
    return Problem(code, what.format(d=d, n=len(items), first=items[0], arch=facts.arch, engine=engine or "this"), fix)


def _matches(target: str, names) -> list[str]:
    """PEFT's matching of a target list entry: the name itself or a dotted suffix of it."""
    return [n for n in names if n == target or n.endswith("." + target)]


def target_problems(
    d: Path, cfg: dict, tensors: dict, facts: ModelFacts, router_lora: str | None = None, engine: str | None = None
) -> list[Problem]:
    """Targets that name nothing in the model (PEFT refuses when none does, ignores the others), targets that name
    modules the adapter has no tensors for, and router targets an engine refuses."""
    tm, tp = cfg.get("target_modules"), list(cfg.get("target_parameters") or [])
    universe = [*facts.modules, *facts.layout.per_expert_paths()]
    have = set()
    for k in tensors:
        try:
            have.add(re.sub(r"(\.base_layer)+$", "", facts.layout.memory_path(k)[0]))
        except ValueError:
            continue
    if isinstance(tm, str):
        entries = [] if tm in ("all-linear", "all") else [tm]
        hits = {t: [n for n in universe if re.fullmatch(t, n)] for t in entries}
        empty = [t for t in entries if hits[t] and not any(re.fullmatch(t, m) for m in have)]
    else:
        entries = list(tm or [])
        hits = {t: _matches(t, universe) for t in entries}
        empty = [t for t in entries if hits[t] and not _matches(t, have)]
    hits.update({t: _matches(t, facts.params) for t in tp})
    empty += [t for t in tp if hits[t] and not {p.rsplit(".", 1)[0] for p in hits[t]} & have]
    dead = [t for t in (*entries, *tp) if not hits[t]]
    out = []
    if dead and len(dead) == len(entries) + len(tp):
        out.append(
            Problem(
                "targets-match-nothing",
                f"adapter {d}: no target ({', '.join(dead)}) names a module or "
                f"parameter of this {facts.arch} model, so nothing would be adapted (PEFT refuses it)",
                "use an adapter made for this model (lpdiff adapters gen --model MODEL ...)",
            )
        )
    elif dead:
        out.append(
            Problem(
                "target-matches-nothing",
                f"adapter {d}: target(s) {', '.join(dead)} name nothing in this {facts.arch} model and are ignored",
                "drop them from target_modules/target_parameters or fix their names",
                severity="warning",
            )
        )
    if empty:
        out.append(
            Problem(
                "target-without-tensors",
                f"adapter {d}: target(s) {', '.join(empty)} name modules of the "
                "model but the adapter has no tensors for them: PEFT wraps them with zero or random "
                "weights, other engines skip them",
                "drop them from target_modules/target_parameters, or save the adapter with their tensors",
            )
        )
    routers = sorted({r for t in hits.values() for r in t if re.sub(r"\.weight$", "", r) in facts.routers})
    if routers and router_lora == "refused" and not any(p.code == "router-target" for p in out):
        out.append(_problem("router-target", routers, d, facts, engine))
    return out


def adapter_problems(
    adapter_dir: str | Path,
    facts: ModelFacts,
    num_layers: int | None = None,
    router_lora: str | None = None,
    engine: str | None = None,
    arg: str = "adapter",
) -> list[Problem]:
    """Every problem of one adapter on one model (errors and warnings); unreadable files raise ValidationError.
    Kept per (files, model, engine facts): engines and commands ask again for the same adapter."""
    d = Path(adapter_dir)
    cfg = read_adapter_config(d, arg)
    stats = tuple((p.name, s.st_size, s.st_mtime_ns) for p in sorted(d.iterdir()) if p.is_file() for s in [os.stat(p)])
    key = (str(d.resolve()), stats, facts.key, num_layers, router_lora, engine)

    def make() -> list[Problem]:
        tensors = read_tensors(d)
        if not tensors:
            return [
                Problem(
                    "empty-adapter",
                    f"adapter {d}: {WEIGHTS_NAME} holds no tensors, so the adapter changes nothing",
                    "save the trained adapter's weights (PEFT's save_pretrained)",
                )
            ]
        arch = _arch_problem(d, cfg, facts)
        return [*([arch] if arch else []), *tensor_problems(d, cfg, tensors, facts, num_layers, router_lora, engine)]

    return list(_remember(_CHECKED, key, make))


def check_adapters(spec, adapters: dict, router_lora: str | None = None, engine: str | None = None) -> None:
    """Refuse (ValidationError, one line) the first adapter of ``adapters`` (name -> AdapterSpec) with an error
    problem on model ``spec``; ``router_lora`` is the engine's Capabilities.router_lora when one is known."""
    if not adapters:
        return
    facts = model_facts(spec)
    for name, a in adapters.items():
        problems = adapter_problems(a.path, facts, spec.num_layers, router_lora, engine, arg=f"adapter {name!r}:")
        first_error(problems, f"lpdiff doctor {spec.name} {a.path}")
