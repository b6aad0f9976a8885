"""The doctor stage before any engine starts: the user's adapters (directories, Hub repos) are checked against the
model for the engines that will run (``pipeline.doctor.refusals``), and an error stops the run with every finding
and its fix (exit 2).

Zoo adapters are not checked: they are lpdiff's own fixtures, each engine's handling of them is tested, and the
doctor reports raw-engine defects (vLLM's mixed MoE-LoRA format, SGLang's PEFT 3D experts) that lpdiff's engine
wrappers work around for them.
"""

from __future__ import annotations

from collections.abc import Iterable

from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.spec.resolve import Resolved


def preflight(r: Resolved, engines: Iterable[str], log=lambda s: None, verdict: str = "prefill") -> None:
    """SpecError listing every error finding (with its fix) of the user's adapters on ``engines`` in a ``verdict``
    ("prefill", or "decode": lpdiff run --decode)."""
    from lpdiff.harness.pipeline.doctor import refusals

    engines = list(dict.fromkeys(engines))
    problems, seen = [], set()
    for name in r.user_adapters:
        for engine in engines:
            found = refusals(r.spec, r.adapters[name].path, engine, verdict)
            for f in found.errors + found.warnings:
                if (name, f.engine, f.code, f.message) in seen:  # an "all" finding holds for every engine once
                    continue
                seen.add((name, f.engine, f.code, f.message))
                if f.severity == "error":
                    problems.append(f"adapter {name!r} [{f.engine}] {f.message} -- fix: {f.fix}")
                else:
                    log(f"doctor: adapter {name!r} [{f.engine}] warning: {f.message} (fix: {f.fix})")
    if problems:
        raise SpecError(
            f"lpdiff doctor found {len(problems)} error(s) before starting {', '.join(engines)}:\n  "
            + "\n  ".join(problems)
        )
