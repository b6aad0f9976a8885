"""The one input-validation layer: every engine and command checks prompts, adapters and runs here, so a bad input
is one ``ValidationError`` (one line naming the file or argument, what is wrong and the fix; CLI exit 2) whoever
meets it first, and ``lpdiff doctor`` reports the same adapter problems."""
from lpdiff.harness.spec.validate.adapters import (
    ModelFacts,
    adapter_problems,
    check_adapters,
    model_facts,
    read_adapter_config,
)
from lpdiff.harness.spec.validate.errors import Problem, ValidationError, first_error
from lpdiff.harness.spec.validate.prompts import (
    check_prompt,
    check_prompts,
    model_limits,
)
from lpdiff.harness.spec.validate.runs import (
    LOGPROB_TOL,
    check_reference_runs,
    check_run,
    check_run_pair,
    check_topk_consistency,
    load_run,
    load_run_pair,
)

__all__ = [
    "LOGPROB_TOL",
    "ModelFacts",
    "Problem",
    "ValidationError",
    "adapter_problems",
    "check_adapters",
    "check_prompt",
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
