"""The pure-torch sequence ops of transformers' hybrid mixers, for the hf engine's fp32 runs.

transformers 5.17 decorates the sequence ops its hybrids call by module-level name (Qwen3.5, Qwen3.5-MoE and
Qwen3-Next: ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
``causal_conv1d_update``; Nemotron-H: the causal conv1d pair and the Mamba-2 scans) with
``use_kernel_func_from_hub_with_fallback`` (integrations/hub_kernels.py): when ``fla``, ``causal_conv1d`` or
``mamba_ssm`` imports, that name calls the package's kernel instead of the torch function it wraps. fla's Triton dots
take fp32 inputs at TF32 precision: on an H200 with fla-core 0.5.2 installed, lpdiff's triton runtime in fp32 (its
own torch delta rule, engines/triton/gdn.py) FAILed against HF fp32 on Qwen3.5-35B-A3B x4 layers (prompts up to 4609
tokens): base k2 1.75e-5, max |Δ| 0.0234, against a threshold of k2 7.6e-7 (30 x HF grouped_mm-vs-eager noise);
without fla the two differed by ~3.6e-5 max |Δ| at full width. An fp32 reference must be IEEE fp32, so fp32 runs call
the torch functions (each wrapper's ``__wrapped__``, set by functools.wraps) for the time of the forward and restore
the module's names after; 16-bit runs keep the kernels, which the engines under test run too."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType

_MODELS_PACKAGE = "transformers.models."


def modeling_modules(model) -> tuple[ModuleType, ...]:
    """The transformers modeling modules that define ``model``'s submodules (a PeftModel's base model included)."""
    names = {type(m).__module__ for m in model.modules()}
    return tuple(sys.modules[n] for n in sorted(names) if n.startswith(_MODELS_PACKAGE) and n in sys.modules)


def _hub_wrapper_file() -> str | None:
    try:
        from transformers.integrations import hub_kernels
    except ImportError:  # a transformers without kernel wrappers: nothing to swap
        return None
    return hub_kernels.__file__


def _is_hub_wrapper(fn: object, hub_file: str) -> bool:
    """Whether ``fn`` (or a wrapper on the way down its ``__wrapped__`` chain) is the closure that
    use_kernel_func_from_hub_with_fallback builds (its code lives in hub_kernels.py; functools.wraps copies the name
    and docstring of the torch function, not the code)."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_filename == hub_file:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _torch_call(torch_fn: Callable) -> Callable:
    """``torch_fn`` called as transformers' wrapper calls it when no kernel package imports: keyword arguments it
    does not name (``cu_seqlens``, attention kwargs) are dropped."""
    params = set(inspect.signature(torch_fn).parameters)

    @functools.wraps(torch_fn)
    def call(*args, **kwargs):
        return torch_fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


def torch_swaps(modules: Iterable[ModuleType]) -> list[tuple[ModuleType, str, Callable]]:
    """(module, name, its torch path) for every module-level name that holds a kernel-or-torch wrapper."""
    hub_file = _hub_wrapper_file()
    if hub_file is None:
        return []
    out = []
    for mod in modules:
        for name, fn in list(vars(mod).items()):
            if not callable(fn) or not hasattr(fn, "__wrapped__") or not _is_hub_wrapper(fn, hub_file):
                continue
            torch_fn = inspect.unwrap(fn)
            # the torch function: defined in a modeling module (its own, or the one it was copied from)
            if str(getattr(torch_fn, "__module__", "")).startswith(_MODELS_PACKAGE):
                out.append((mod, name, _torch_call(torch_fn)))
    return out


@contextmanager
def torch_paths(modules: Iterable[ModuleType]) -> Iterator[list[str]]:
    """Within: ``modules``' wrapped sequence ops call their torch functions (yields the swapped names); after: the
    names hold what they held before, whatever that was (a tracer's wrapper, a kernel)."""
    swaps = torch_swaps(modules)
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
    try:
        for mod, name, fn in swaps:
            setattr(mod, name, fn)
        yield [f"{mod.__name__}.{name}" for mod, name, _ in swaps]
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
