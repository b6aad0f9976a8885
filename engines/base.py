"""The engine protocol and the lazy registry of engines by name.

An engine computes prompt logprobs for token-id prompts, each prompt with one of the engine's adapters or none.
Engines are context managers: leaving the ``with`` block frees the GPU (and stops worker processes). Registry
entries are import strings, so naming ``vllm`` on a CPU box that lacks it fails only when that engine is opened.
Each engine module declares ``CAPABILITIES`` (engines/capabilities.py); adding an engine is its module plus one
line in ``ENGINES``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from lpdiff.engines.capabilities import DTYPES, Capabilities, Mode
from lpdiff.harness.types import AdapterSpec, ModelSpec, PromptLogprobs


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


# What ``capture_layers`` returns, per (layer index, point): every tensor is (tokens, width) over the prompts'
# tokens in order, except the routing (tokens, top-k ids and weights). "_base" points are the same module re-run on
# the same input with the adapter off. An engine leaves out the points it cannot capture.
CAPTURE_POINTS = ("attention_in", "attention", "attention_base", "experts_in", "router_ids", "router_weights",
                  "experts", "experts_base", "hidden")


@runtime_checkable
class CapturesLayers(Protocol):
    """Optional: an engine whose ``Capabilities.per_layer_capture`` is True offers per-layer module outputs
    (lpdiff bisect), so the harness never drives the engine's internals."""

    def capture_layers(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None,
                       inputs: dict[tuple[int, str], Any] | None = None) -> dict[tuple[int, str], Any]:
        """Equal-length prompts (no padding) -> {(layer, point): tensor} for the CAPTURE_POINTS the engine has.
        ``adapter``: as prompt_logprobs (triton takes one choice per prompt; hf one name or None for all).
        Without ``inputs`` each module sees the engine's own activations. With ``inputs`` (another engine's
        capture) attention and experts re-run on that capture's "attention_in" / "experts_in", "router_ids" and
        "router_weights" (its own routing of "experts_in" is reported), so each module's error is its own;
        "hidden" is always the engine's free run."""
        ...


def dense_routing(ids, weights, num_experts: int):
    """Top-k routing (tokens, k) ids and weights -> (tokens, experts) fp32 weights: two engines' routings compare
    whatever order each lists a token's top k in."""
    w = weights.float()
    return w.new_zeros(ids.shape[0], num_experts).scatter_(1, ids.long(), w)


def check_request(prompts: Sequence[Sequence[int]], adapter: AdapterChoice, known: dict[str, Any],
                  model: ModelSpec | None = None) -> list[str | None]:
    """What every engine checks before any work, through the harness's one validation layer: a non-empty list of
    integer prompts of >= 2 tokens (ids in ``model``'s vocabulary, within its positions), and adapter choices that
    name adapters the engine was opened with. Returns one adapter name (or None) per prompt."""
    from lpdiff.harness.spec.validate import check_prompts, model_limits

    vocab, positions = model_limits(model) if model is not None else (None, None)
    check_prompts(prompts, vocab, positions, source=f"prompts for {model.name}" if model is not None else "prompts")
    return per_prompt_adapters(adapter, len(prompts), known)


def check_adapters(config: EngineConfig, engine: str) -> None:
    """Every adapter of ``config`` against its model, before the engine loads any (the validation layer's checks,
    with the router rule of ``engine``'s capabilities)."""
    from lpdiff.harness.spec.validate import check_adapters as check

    check(config.model, config.adapters, router_lora=capabilities(engine).router_lora, engine=engine)


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


def _target(name: str) -> tuple[str, str]:
    try:
        module, cls = ENGINES[name].split(":")
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; known engines: {', '.join(sorted(ENGINES))}") from None
    return module, cls


def engine_class(name: str) -> type:
    module, cls = _target(name)
    return getattr(importlib.import_module(module), cls)


def capabilities(name: str) -> Capabilities:
    """The engine's declared facts (its module's ``CAPABILITIES``), read without importing the engine's own
    library: works for vllm and sglang on a machine that has neither."""
    caps = importlib.import_module(_target(name)[0]).CAPABILITIES
    assert isinstance(caps, Capabilities) and caps.engine == name, f"{name}: CAPABILITIES is not its own"
    return caps


def layouts_for(engine: str, arch: str) -> tuple[str, ...]:
    """The expert adapter layouts ``engine`` reads correctly on model type ``arch``: what a check serves it."""
    return capabilities(engine).layouts_for(arch)


def max_rank(engine: str) -> int | None:
    """The largest LoRA rank ``engine`` accepts (None: no limit)."""
    return capabilities(engine).max_rank


def engine_modes(engine: str) -> dict[str, Mode]:
    """Metamorphic modes: name -> Mode(options, needs)."""
    return capabilities(engine).mode_table()


def open_engine(name: str, config: EngineConfig) -> Engine:
    """``with open_engine("hf", cfg) as eng: eng.prompt_logprobs(...)``"""
    return engine_class(name)(config)
