"""The doctor stage's facts: what the checks (doctor.py) and the detectors (doctor_detectors.py) read about one
adapter on one model, gathered once, and the ``Finding`` each check returns.

The model's structure: the model is built on the meta device (no weights, so full-size configs are fine) and its
module and parameter names are read. The adapter: ``inspect_adapter`` (config and tensor keys, no model). PEFT
itself: the adapter's LoraConfig injected into the meta model (that is where PEFT refuses routers it cannot wrap and
Nemotron's Mamba out_proj/conv1d).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lpdiff.engines import ENGINES as ALL_ENGINES
from lpdiff.engines import capabilities

# the engines whose adapter handling the doctor knows (Capabilities.adapter_doctor; triton reads every layout)
ENGINES = tuple(e for e in ALL_ENGINES if capabilities(e).adapter_doctor)
SEVERITIES = ("error", "warning", "info")


@dataclass(slots=True, frozen=True)
class Finding:
    engine: str  # one of ENGINES, or "all" (the adapter does not fit the model whatever runs it)
    severity: str  # error: will fail or silently compute something else; warning: may; info: handled/know this
    code: str  # stable short name, e.g. "router-target"
    message: str  # one line
    fix: str  # one line

    def __post_init__(self):
        assert self.engine in (*ENGINES, "all") and self.severity in SEVERITIES
        assert "\n" not in self.message and "\n" not in self.fix


@dataclass(slots=True)
class Facts:
    """Everything the checks read, gathered once."""

    arch: str
    num_experts: int  # 0: dense
    modules: dict[str, str]  # module path -> class name (meta-device model)
    params: set[str]
    routers: set[str]  # router module paths: a 'gate'/'router' beside an 'experts' module
    expert_modules: dict[str, tuple[str, ...]]  # experts module -> its per-expert projection names
    info: Any  # harness.adapters.AdapterInfo
    config: dict[str, Any]  # adapter_config.json
    key_modules: set[str]  # module paths the adapter's tensors are for (in-memory names)
    foreign_keys: list[str]  # tensor keys that are not plain LoRA A/B weights
    peft_error: str | None  # what PEFT raised injecting the adapter's LoraConfig, if it did
    peft_modules: set[str]  # modules PEFT wrapped (target_modules)
    peft_params: set[str]  # parameters PEFT wrapped (target_parameters, and routers it converts to them)
    limits: dict[str, int]  # engine -> max_lora_rank the user runs it with
    model_ref: str = "MODEL"  # how the user named the model (for the commands in fixes)
    problems: list = field(default_factory=list)  # the validation layer's Problems: what a run refuses (or warns)

    @property
    def max_rank(self) -> int:
        return max([self.info.rank, *self.info.rank_pattern.values()])

    @property
    def target_leaves(self) -> set[str]:
        """Leaf names the adapter targets: from its tensors, and from target_modules when that is a list."""
        tm = self.config.get("target_modules")
        names = set(tm) if isinstance(tm, (list, tuple)) else set()
        return {n.rsplit(".", 1)[-1] for n in names | self.key_modules}


def _resolve_model(model) -> Any:
    """A ModelSpec as given; a catalog name, checkpoint directory or Hub id[@rev] through the one resolver (config
    and tokenizer only: doctor never needs the weights)."""
    from lpdiff.harness.types import ModelSpec

    if isinstance(model, ModelSpec):
        return model
    from lpdiff.harness.spec.resolve import resolve_model

    return resolve_model(str(model), weights=False)


# PEFT's injection depends only on the model's config and the adapter's adapter_config.json, not on its tensors:
# the metamorphic suite asks the doctor about a dozen transformed copies of one adapter (same config, or only
# r/alpha changed), so it is kept per config (bounded: a handful of models per process); the model's facts are
# the validation layer's (built once per config there). The cached values are only read.
_CACHE_SIZE = 16
_PEFT_CACHE: dict[tuple[str, str], tuple] = {}  # (model config JSON, adapter_config.json text) -> _peft_inject


def _remember(cache: dict, key, make: Callable[[], Any]) -> Any:
    if key not in cache:
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return cache[key]


def _peft_inject(model, adapter_dir: str) -> tuple[str | None, set[str], set[str]]:
    """Let PEFT itself say whether it accepts the adapter's LoraConfig on this model, and what it wraps."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model

    try:
        cfg = LoraConfig.from_pretrained(adapter_dir)
        # on meta, as the model is: PEFT would otherwise random-initialise real LoRA weights (0.1-0.5 s per call
        # at full width) only to move them to meta
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            tuner = get_peft_model(model, cfg).base_model
    except Exception as e:  # noqa: BLE001 - PEFT's refusal is the finding
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}", set(), set()
    return None, set(tuner.targeted_module_names), set(getattr(tuner, "targeted_parameter_names", ()))


def gather(spec, adapter_dir: str | Path, limits: dict[str, int] | None = None, model_ref: str = "") -> Facts:
    """The facts of a resolved model (a ModelSpec) and an adapter directory; ``model_ref``: how the user named the
    model (default its name). Unreadable adapter files (no directory, broken JSON, pickle weights) raise the
    validation layer's one-line ValidationError (exit 2); what the files hold is checked by its
    ``adapter_problems``."""
    from lpdiff.harness.spec.adapters import inspect_adapter
    from lpdiff.harness.spec.validate import adapter_problems, model_facts, read_adapter_config

    adapter_dir = str(adapter_dir)
    config = read_adapter_config(adapter_dir)
    config_text = (Path(adapter_dir) / "adapter_config.json").read_text()
    mf = model_facts(spec)
    problems = adapter_problems(adapter_dir, mf, spec.num_layers)
    info = inspect_adapter(adapter_dir)
    model_key, meta, layout, modules, params = mf.key, mf.meta, mf.layout, mf.modules, mf.params
    experts = {p.module: p for p in layout.experts.values()}
    expert_modules = {
        m: tuple(part for q in layout.experts.values() if q.module == m for part in q.parts) for m in experts
    }
    routers = set(mf.routers)
    key_modules, foreign = set(), []
    for k in info.keys:
        try:
            key_modules.add(layout.memory_path(k)[0])
        except ValueError:
            foreign.append(k)
    num_experts = max((p.num_experts for p in layout.experts.values()), default=0)
    peft_error, peft_modules, peft_params = _remember(
        _PEFT_CACHE, (model_key, config_text), lambda: _peft_inject(copy.deepcopy(meta), adapter_dir)
    )
    return Facts(
        arch=layout.model_type,
        num_experts=num_experts,
        modules=dict(modules),
        params=set(params),
        routers=routers,
        expert_modules=expert_modules,
        info=info,
        config=config,
        key_modules=key_modules,
        foreign_keys=foreign,
        peft_error=peft_error,
        peft_modules=set(peft_modules),
        peft_params=set(peft_params),
        limits=dict(limits or {}),
        model_ref=model_ref or spec.name,
        problems=problems,
    )
