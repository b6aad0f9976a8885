"""Does an adapter fit a model's shapes? Read from the adapter's safetensors header and the model built on the meta
device (no weights), before any engine starts: an adapter trained for another architecture or size is one SpecError
naming its first mismatching tensors, instead of a shape error deep in an engine. Targets the model lacks only
in part are left to ``lpdiff doctor`` (it names them with the fix); an adapter none of whose tensors name a module
of the model is refused here."""
from __future__ import annotations

import re

from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.types import AdapterSpec, ModelSpec

_BASE_LAYER = re.compile(r"(\.base_layer)+$")
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)")


def _expert_dims(layout, module: str) -> tuple[int, set[int]]:
    params = [p for p in layout.experts.values() if p.module == module]
    dims = {d for p in params for d in (p.in_features, p.out_features, p.out_features // max(1, len(p.parts)))}
    return max(p.num_experts for p in params), dims


def misfits(layout, shapes: dict[str, tuple[int, ...]]) -> tuple[list[str], int]:
    """-> (one line per tensor whose shape the model cannot take, how many tensors name a module of the model)."""
    bad, found = [], 0
    for key, shape in sorted(shapes.items()):
        try:
            module, ab = layout.memory_path(key)
        except ValueError:
            continue  # not a LoRA A/B tensor: doctor reports it
        module = _BASE_LAYER.sub("", module)
        dim = shape[1] if ab == "A" else shape[0]  # A: (r, in); B: (out, r)
        if module in layout.linears:
            found += 1
            out_f, in_f = layout.linears[module]
            want = in_f if ab == "A" else out_f
            if len(shape) != 2 or dim != want:
                bad.append(f"{key} {tuple(shape)} vs {module} (out={out_f}, in={in_f})")
            continue
        pe = _PER_EXPERT.fullmatch(module)
        experts = pe.group(1) if pe else module
        if experts in layout.module_params:
            found += 1
            n, dims = _expert_dims(layout, experts)
            if (pe and int(pe.group(2)) >= n) or len(shape) != 2 or dim not in dims:
                bad.append(f"{key} {tuple(shape)} vs {experts} ({n} experts, dims {sorted(dims)})")
    return bad, found


def check_fit(spec: ModelSpec, config, adapter: AdapterSpec) -> None:
    """SpecError when ``adapter`` cannot be applied to ``spec`` (its ``config``: the transformers config)."""
    from lpdiff.harness.spec.adapters import ModelLayout, inspect_adapter

    try:
        info = inspect_adapter(adapter.path)
    except (OSError, ValueError) as e:
        raise SpecError(f"adapter {adapter.name!r}: {e}") from None
    layout = ModelLayout.from_config(config)
    bad, found = misfits(layout, info.shapes)
    base = f" (trained on {info.base_model_name_or_path})" if info.base_model_name_or_path else ""
    if bad:
        raise SpecError(f"adapter {adapter.name!r} ({adapter.path}){base} does not fit {spec.name} "
                        f"({spec.arch}): {len(bad)} tensor(s) of other shapes, e.g. {'; '.join(bad[:3])}; "
                        "use an adapter trained for this model")
    if not found:
        raise SpecError(f"adapter {adapter.name!r} ({adapter.path}){base} targets no module of {spec.name} "
                        f"({spec.arch}); use an adapter trained for this model")
