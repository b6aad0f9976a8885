"""``lpdiff doctor`` before any engine starts: the user's adapters (directories, Hub repos) are checked against the
model for the engines that will run, and an error stops the run with every finding and its fix (exit 2).

Zoo adapters are not checked: they are lpdiff's own fixtures, each engine's handling of them is tested, and the
doctor reports raw-engine defects (vLLM's mixed MoE-LoRA format, SGLang's PEFT 3D experts) that lpdiff's engine
wrappers work around for them.
"""
from __future__ import annotations

from collections.abc import Iterable

from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.spec.resolve import Resolved


def doctor_engines(engines: Iterable[str]) -> tuple[list[str], set[str]]:
    """-> (engines to ask the doctor about, engines whose findings gate). The doctor knows hf, vllm and sglang;
    for the others (triton) it still checks that the adapter fits the model (findings for "all")."""
    from lpdiff.harness.commands.doctor import ENGINES

    known = [e for e in dict.fromkeys(engines) if e in ENGINES]
    return known or ["hf"], {*known, "all"}


def preflight(r: Resolved, engines: Iterable[str], log=lambda s: None) -> None:
    """SpecError listing every error finding (with its fix) of the user's adapters on ``engines``."""
    from lpdiff.harness.commands.doctor import doctor

    ask, gate = doctor_engines(engines)
    problems = []
    for name in r.user_adapters:
        report = doctor(r.spec, r.adapters[name].path, ask)
        for f in report.findings:
            if f.engine in gate and f.severity == "error":
                problems.append(f"adapter {name!r} [{f.engine}] {f.message} -- fix: {f.fix}")
            elif f.engine in gate and f.severity == "warning":
                log(f"doctor: adapter {name!r} [{f.engine}] warning: {f.message} (fix: {f.fix})")
    if problems:
        engines_ = ", ".join(sorted(gate - {"all"})) or "the engine"
        raise SpecError(f"lpdiff doctor found {len(problems)} error(s) before starting {engines_}:\n  "
                        + "\n  ".join(problems))
