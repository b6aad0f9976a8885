"""The engine protocol and the lazy registry of engines by name.

An engine computes prompt logprobs for token-id prompts, each prompt with one of the engine's adapters or none.
Engines are context managers: leaving the ``with`` block frees the GPU (and stops worker processes). Registry
entries are import strings, so naming ``vllm`` on a CPU box that lacks it fails only when that engine is opened.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from lpdiff.harness.types import AdapterSpec, ModelSpec, PromptLogprobs

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    model: ModelSpec
    adapters: dict[str, AdapterSpec] = field(default_factory=dict)  # name -> adapter; prompts pick by name
    dtype: str = "float32"
    tp: int = 1
    device: str | None = None  # None: cuda when available, else cpu
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific knobs (documented per engine)

    def __post_init__(self):
        assert self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"
        assert self.tp >= 1
        for name, spec in self.adapters.items():
            assert name == spec.name, f"adapter registered as {name!r} but named {spec.name!r}"


AdapterChoice = str | None | Sequence[str | None]


@runtime_checkable
class Engine(Protocol):
    name: str
    config: EngineConfig

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None,
                        top_k: int = 0) -> list[PromptLogprobs]: ...

    def version(self) -> str: ...

    def __enter__(self) -> "Engine": ...

    def __exit__(self, *exc) -> None: ...


def check_request(prompts: Sequence[Sequence[int]], adapter: AdapterChoice, known: dict[str, Any]
                  ) -> list[str | None]:
    """What every engine checks before any work: each prompt has a next token to score, and the adapter choice
    names adapters the engine was opened with. Returns one adapter name (or None) per prompt."""
    for i, p in enumerate(prompts):
        if len(p) < 2:
            raise ValueError(f"prompt {i} has {len(p)} token(s); logprobs need at least 2")
    return per_prompt_adapters(adapter, len(prompts), known)


def per_prompt_adapters(adapter: AdapterChoice, n: int, known: dict[str, Any]) -> list[str | None]:
    """Normalise the adapter argument to one name (or None) per prompt, failing early on unknown names."""
    names = [adapter] * n if adapter is None or isinstance(adapter, str) else list(adapter)
    if len(names) != n:
        raise ValueError(f"got {len(names)} adapter choices for {n} prompts")
    for a in names:
        if a is not None and a not in known:
            raise KeyError(f"unknown adapter {a!r}; this engine was opened with {sorted(known)} "
                           "(pass it in EngineConfig.adapters)")
    return names


ENGINES: dict[str, str] = {
    "hf": "lpdiff.engines.hf:HFEngine",
    "triton": "lpdiff.engines.triton:TritonEngine",
    "vllm": "lpdiff.engines.vllm:VLLMEngine",
    "sglang": "lpdiff.engines.sglang:SGLangEngine",
}


def engine_class(name: str) -> type:
    try:
        target = ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; known engines: {', '.join(sorted(ENGINES))}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def open_engine(name: str, config: EngineConfig) -> Engine:
    """``with open_engine("hf", cfg) as eng: eng.prompt_logprobs(...)``"""
    return engine_class(name)(config)
