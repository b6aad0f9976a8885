"""What an adapter directory holds, read from its config and safetensors header without a model (for doctor and
for naming the module groups a verdict judges)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lpdiff.harness.spec.adapters.files import CONFIG_NAME, WEIGHTS_NAME, read_provenance
from lpdiff.harness.spec.adapters.layout import (
    GROUPS,
    PEFT_PREFIX,
    PER_EXPERT_RE,
    key_module,
    module_group,
    pattern_value,
)
from lpdiff.harness.spec.errors import InputError


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
    layout: str  # "peft3d" | "per_expert" | "dense_only" (per_expert_gate reads as per_expert without the model)
    keys: list[str]  # tensor keys, sorted
    shapes: dict[str, tuple[int, ...]]
    dtypes: list[str]  # tensor dtypes present
    groups: list[str]  # module groups present (GROUPS, plus "router"/"other" when an adapter has them)
    num_experts: int | None  # per_expert: experts seen; peft3d: rows of A / r
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)  # lpdiff_adapter.json, when lpdiff made it

    def modules(self) -> set[str]:
        """The module paths the file names (keys after ``base_model.model.``, without ``.lora_A.weight``)."""
        return {(m[0] if (m := key_module(k)) else k).removeprefix(PEFT_PREFIX) for k in self.keys}

    def outside_root(self, root: str) -> list[str]:
        """The modules not under decoder root ``root`` (e.g. "model.language_model"): what an engine that reads
        adapter names under that root cannot place."""
        prefix = root.rstrip(".") + "."
        return sorted(m for m in self.modules() if not m.startswith(prefix))


def several(names: Sequence[str]) -> str:
    """The first name and how many more: how a one-line message points at a list of modules."""
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def peft3d_expert_count(three_d: list[str], shapes: dict, cfg: dict, rank: int) -> int | None:
    """The expert count a PEFT 3D adapter was written for: each wrapped expert parameter's lora_A holds r x
    num_experts rows, with r the adapter's rank or its rank_pattern's for that parameter. Which nesting level
    (experts.base_layer....lora_A) is which parameter is PEFT's business, so the count is the one every lora_A agrees
    on for some rank the config allows (a rank_pattern of 4 on down_proj beside r 16 on gate_up read 32 experts for 8
    when one pattern was applied to every parameter)."""
    ranks = {rank}
    for k in three_d:
        m = key_module(k)
        module = re.sub(r"(\.base_layer)+$", "", m[0] if m else k).removeprefix(PEFT_PREFIX)
        for p in ("gate_up_proj", "up_proj", "gate_proj", "down_proj"):
            if (v := pattern_value(cfg.get("rank_pattern"), f"{module}.{p}")) is not None:
                ranks.add(int(v))
    rows = {shapes[k][0] for k in three_d if k.endswith("lora_A.weight")}
    fits = set.intersection(*({n // r for r in ranks if n % r == 0} for n in rows)) if rows else set()
    # several counts fit only where the ranks are multiples of each other: prefer one read at the adapter's own rank
    return min(fits, key=lambda e: (e * rank not in rows, e)) if fits else None


def inspect_adapter(adapter_dir: str | Path) -> AdapterInfo:
    from safetensors import safe_open

    adapter_dir = Path(adapter_dir)
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise InputError(f"{adapter_dir} has no {CONFIG_NAME}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    weights = adapter_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise InputError(f"{adapter_dir} has no {WEIGHTS_NAME} (lpdiff reads safetensors adapters only)")
    shapes, dtypes = {}, set()
    with safe_open(str(weights), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            sl = f.get_slice(k)
            shapes[k] = tuple(sl.get_shape())
            dtypes.add(sl.get_dtype())
    keys = sorted(shapes)
    groups, experts_seen, three_d, rank = set(), set(), [], int(cfg.get("r", 0))
    for k in keys:
        m = key_module(k)
        mod = m[0] if m else k
        groups.add(module_group(mod))
        pe = PER_EXPERT_RE.fullmatch(mod)
        if pe:
            experts_seen.add(int(pe.group(2)))
        elif re.search(r"\.experts(\.base_layer)*$", mod):
            three_d.append(k)
    if experts_seen and three_d:
        raise InputError(f"{adapter_dir} mixes the peft3d and per_expert expert layouts")
    layout = "per_expert" if experts_seen else "peft3d" if three_d else "dense_only"
    num_experts = None
    if experts_seen:
        num_experts = max(experts_seen) + 1
    elif three_d and rank:
        num_experts = peft3d_expert_count(three_d, shapes, cfg, int(rank))
    return AdapterInfo(
        path=str(adapter_dir),
        rank=rank,
        alpha=float(cfg.get("lora_alpha", 0)),
        rslora=bool(cfg.get("use_rslora", False)),
        target_modules=cfg.get("target_modules"),
        target_parameters=cfg.get("target_parameters"),
        base_model_name_or_path=cfg.get("base_model_name_or_path"),
        layout=layout,
        keys=keys,
        shapes=shapes,
        dtypes=sorted(dtypes),
        groups=sorted(groups),
        num_experts=num_experts,
        rank_pattern=dict(cfg.get("rank_pattern") or {}),
        alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
        provenance=read_provenance(adapter_dir),
    )


def adapter_groups(adapter_dir: str | Path) -> tuple[str, ...]:
    """The module groups (GROUPS) an adapter's tensors touch, from the file's keys alone: an adapter with exactly
    one is that group's lane, whose delta fidelity a verdict reports under the group's name."""
    from safetensors import safe_open

    weights = Path(adapter_dir) / WEIGHTS_NAME
    if not weights.is_file():
        raise InputError(f"{adapter_dir} has no {WEIGHTS_NAME} (lpdiff reads safetensors adapters only)")
    with safe_open(str(weights), framework="pt") as f:
        keys = list(f.keys())
    found = set()
    for k in keys:
        m = key_module(k)
        found.add(module_group(m[0] if m else k))
    return tuple(g for g in GROUPS if g in found)


def adapter_max_rank(adapter_dir: str | Path) -> int:
    """The largest rank an adapter uses (``r`` and every ``rank_pattern`` entry): the max LoRA rank an engine that
    preallocates LoRA buffers (vLLM, SGLang) must be started with."""
    info = inspect_adapter(adapter_dir)
    return max([info.rank, *info.rank_pattern.values()])
