"""Resolve what a command names — a model, its adapters, a prompt set — once, into specs every later stage uses."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.types import AdapterSpec, ModelSpec

ZOO_ADAPTERS = Path(__file__).resolve().parents[1] / "zoo_adapters"


class SpecError(ValueError):
    """A model, adapter or prompt set that cannot be resolved; the message names it and the fix."""


def zoo_adapters(model: str) -> dict[str, AdapterSpec]:
    """The committed adapters of a tiny zoo model: harness/zoo_adapters/<model>/<adapter>/ (PEFT format)."""
    root = ZOO_ADAPTERS / model
    if not root.is_dir():
        return {}
    return {p.name: AdapterSpec(p.name, str(p)) for p in sorted(root.iterdir()) if (p / "adapter_config.json").exists()}


@dataclass(slots=True)
class Resolved:
    spec: ModelSpec
    adapters: dict[str, AdapterSpec]
    prompts: list[list[int]]

    def __iter__(self):  # spec, adapters, prompts = resolve(...)
        return iter((self.spec, self.adapters, self.prompts))


def resolve(model: str, adapters: Sequence[str] | None = None, prompts: str = "default",
            num_layers: int | None = None) -> Resolved:
    """``adapters`` None = every committed adapter of the model."""
    try:
        spec = get_model(model, num_layers=num_layers)
    except KeyError as e:
        raise SpecError(str(e).strip("'\"")) from None
    available = zoo_adapters(model)
    names = list(available) if adapters is None else list(adapters)
    missing = [n for n in names if n not in available]
    if missing:
        raise SpecError(f"model {model!r} has no adapter(s) {missing}; available: {sorted(available)}")
    try:
        ids = prompt_set(model, prompts)
    except KeyError as e:
        raise SpecError(str(e).strip("'\"")) from None
    return Resolved(spec, {n: available[n] for n in names}, ids)
