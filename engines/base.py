"""The engine protocol and the lazy registry of engines by name.

An engine computes prompt logprobs for token-id prompts, each prompt with one of the engine's adapters or none.
Engines are context managers: leaving the ``with`` block frees the GPU (and stops worker processes). Registry
entries are import strings, so naming ``vllm`` on a CPU box that lacks it fails only when that engine is opened.
Each engine module declares ``CAPABILITIES`` (engines/capabilities.py); adding an engine is its module plus one
line in ``ENGINES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lpdiff.engines.capabilities import DTYPES, Capabilities, Mode
from lpdiff.engines.registry import ENGINES
from lpdiff.harness.spec.errors import InputError, UnknownName
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

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None, top_k: int = 0
    ) -> list[PromptLogprobs]: ...

    def version(self) -> str: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc) -> None: ...


SAMPLINGS = ("greedy", "seeded")  # decode: argmax, or a draw from the raw distribution (temperature 1) with a seed


@dataclass(slots=True)
class Generated:
    """One decoded sequence: ``tokens`` generated after ``prompt`` and the engine's own log p(token | prefix) for
    each, from the raw logits (no temperature, top-p or penalty applied; every engine asked for them so). Engines
    generate exactly ``max_new_tokens`` (EOS does not stop them), so sequences of one call have one length."""

    prompt: list[int]
    tokens: list[int]
    logprobs: Any  # np.ndarray (len(tokens),) float32

    @property
    def sequence(self) -> list[int]:
        return [*self.prompt, *self.tokens]


@dataclass(frozen=True, slots=True)
class Decoding:
    """How a decode draws: ``max_new_tokens`` per prompt (EOS does not stop them); ``sampling`` one of SAMPLINGS,
    "seeded" drawing prompt i's tokens with seed ``seed + i`` (so a prompt's tokens do not depend on the rest of the
    batch, where the engine allows it). Checked here, once: a bad value is an InputError naming it."""

    max_new_tokens: int = 16
    sampling: str = "greedy"
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.sampling not in SAMPLINGS:
            raise InputError(f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise InputError(f"seed must be a non-negative integer, got {self.seed!r}")


@runtime_checkable
class Decodes(Protocol):
    """Optional: an engine that generates (vLLM, SGLang, HF)."""

    def decode(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice, how: Decoding) -> list[Generated]: ...


def decode_by_prefill(
    engine: Engine, prompts: Sequence[Sequence[int]], adapter: AdapterChoice, how: Decoding
) -> list[Generated]:
    """Greedy decoding for an engine without a KV cache (the triton runtime, prefill-only): each step re-prefills
    every sequence with one placeholder token appended and takes the top-1 of its last position (the argmax of the
    next-token distribution and its logprob). N steps cost N prefills of the growing sequences; seeded sampling
    would need the whole distribution, so it is refused."""
    if how.sampling != "greedy":
        raise InputError(
            f"{engine.name}: decoding by re-prefill takes the top-1 only; seeded sampling needs an "
            "engine with its own decode (hf, vllm, sglang)"
        )
    seqs = [[int(t) for t in p] for p in prompts]
    gen: list[list[int]] = [[] for _ in seqs]
    lps: list[list[float]] = [[] for _ in seqs]
    for _ in range(how.max_new_tokens):
        res = engine.prompt_logprobs([[*s, *g, 0] for s, g in zip(seqs, gen)], adapter, top_k=1)
        for i, r in enumerate(res):
            if r.topk_ids is None or r.topk_logprobs is None:
                raise RuntimeError(f"{engine.name} returned no top-1 entries when asked for top_k=1")
            gen[i].append(int(r.topk_ids[-1, 0]))
            lps[i].append(float(r.topk_logprobs[-1, 0]))
    import numpy as np

    return [Generated(s, g, np.asarray(lp, dtype=np.float32)) for s, g, lp in zip(seqs, gen, lps)]


def decode(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    adapter: AdapterChoice = None,
    max_new_tokens: int = 16,
    sampling: str = "greedy",
    seed: int = 0,
) -> tuple[list[Generated], str]:
    """The engine's own decode where it has one, else greedy re-prefill; -> (sequences, "decode" or "re-prefill")."""
    how = Decoding(max_new_tokens, sampling, seed)
    if isinstance(engine, Decodes):
        return engine.decode(prompts, adapter, how), "decode"
    return decode_by_prefill(engine, prompts, adapter, how), "re-prefill"


# What ``capture_layers`` returns, per (layer index, point): every tensor is (tokens, width) over the prompts'
# tokens in order, except the routing (tokens, top-k ids and weights). "_base" points are the same module re-run on
# the same input with the adapter off. An engine leaves out the points it cannot capture.
CAPTURE_POINTS = (
    "attention_in",
    "attention",
    "attention_base",
    "experts_in",
    "router_ids",
    "router_weights",
    "experts",
    "experts_base",
    "hidden",
)


@runtime_checkable
class CapturesLayers(Protocol):
    """Optional: an engine whose ``Capabilities.per_layer_capture`` is True offers per-layer module outputs
    (lpdiff bisect), so the harness never drives the engine's internals."""

    def capture_layers(
        self,
        prompts: Sequence[Sequence[int]],
        adapter: AdapterChoice = None,
        inputs: dict[tuple[int, str], Any] | None = None,
        steps: Sequence[int] = (),
    ) -> dict[tuple[int, str], Any]:
        """Equal-length prompts (no padding) -> {(layer, point): tensor} for the CAPTURE_POINTS the engine has.
        ``adapter``: as prompt_logprobs (triton takes one choice per prompt; hf one name or None for all).
        Without ``inputs`` each module sees the engine's own activations. With ``inputs`` (another engine's
        capture) attention and experts re-run on that capture's "attention_in" / "experts_in", "router_ids" and
        "router_weights" (its own routing of "experts_in" is reported), so each module's error is its own;
        "hidden" is always the engine's free run. ``steps``: layers whose Mamba-2 / Gated DeltaNet mixer also
        reports its sub-steps as "<mixer>.<step>" (harness/commands/bisect_steps.py STEPS; hf and triton at TP 1)."""
        ...


def dense_routing(ids, weights, num_experts: int):
    """Top-k routing (tokens, k) ids and weights -> (tokens, experts) fp32 weights: two engines' routings compare
    whatever order each lists a token's top k in."""
    w = weights.float()
    return w.new_zeros(ids.shape[0], num_experts).scatter_(1, ids.long(), w)


def check_request(
    prompts: Sequence[Sequence[int]], adapter: AdapterChoice, known: dict[str, Any], model: ModelSpec | None = None
) -> list[str | None]:
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
            raise UnknownName(
                f"unknown adapter {a!r}; this engine was opened with {sorted(known)} (pass it in EngineConfig.adapters)"
            )
    return names


def _target(name: str) -> tuple[str, str]:
    try:
        module, cls = ENGINES[name].split(":")
    except KeyError:
        raise UnknownName(f"unknown engine {name!r}; known engines: {', '.join(sorted(ENGINES))}") from None
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
