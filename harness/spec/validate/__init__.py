"""The one input-validation layer: every engine and command checks prompts, adapters and runs here, so a bad input
is one ``ValidationError`` (one line naming the file or argument, what is wrong and the fix; CLI exit 2) whoever
meets it first, and ``lpdiff doctor`` reports the same adapter problems."""

import importlib

from lpdiff.harness.spec.validate.errors import Problem, ValidationError, first_error

# Imported on first use (PEP 562): the adapter checks need torch, and reading a baseline (runs) must not pay for it
_LAZY = {
    **dict.fromkeys(
        ("ModelFacts", "adapter_problems", "check_adapters", "model_facts", "read_adapter_config"), "adapters"
    ),
    **dict.fromkeys(
        ("check_prompt", "check_prompt_array", "check_prompt_arrays", "check_prompts", "model_limits"), "prompts"
    ),
    **dict.fromkeys(
        (
            "LOGPROB_TOL",
            "check_reference_runs",
            "check_run",
            "check_run_pair",
            "check_topk_consistency",
            "load_run",
            "load_run_pair",
        ),
        "runs",
    ),
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOGPROB_TOL",
    "ModelFacts",
    "Problem",
    "ValidationError",
    "adapter_problems",
    "check_adapters",
    "check_prompt",
    "check_prompt_array",
    "check_prompt_arrays",
    "check_prompts",
    "check_reference_runs",
    "check_run",
    "check_run_pair",
    "check_topk_consistency",
    "first_error",
    "load_run",
    "load_run_pair",
    "model_facts",
    "model_limits",
    "read_adapter_config",
]
