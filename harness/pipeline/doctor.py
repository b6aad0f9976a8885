"""The doctor stage: before any engine runs, what each engine will refuse or silently ignore in this adapter on this
model, one finding each with the fix. ``refusals`` is what stops a run (preflight, check, the metamorphic
relations); ``lpdiff doctor`` (commands/doctor.py) prints every finding.

Facts come from three places (doctor_facts.py): the model's structure (built on the meta device), the adapter's
files, and PEFT injecting the adapter's LoraConfig into the meta model. The engines declare their limits and known
defects (``lpdiff.engines.capabilities``, read through ``lpdiff.engines.capabilities(name)``), and the doctor tests
each defect it has a detector for (doctor_detectors.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from lpdiff.engines import capabilities
from lpdiff.engines.capabilities import VERDICTS
from lpdiff.harness.pipeline.doctor_detectors import DETECTORS
from lpdiff.harness.pipeline.doctor_facts import ENGINES, Facts, Finding, _resolve_model, gather
from lpdiff.harness.pipeline.doctor_inputs import check_noop, resolve_adapter
from lpdiff.harness.spec.errors import InputError

RANK_LIMITED = tuple(e for e in ENGINES if capabilities(e).max_lora_rank_option)  # doctor --max-lora-rank


@dataclass(slots=True)
class DoctorReport:
    model: str
    arch: str
    adapter: str
    layout: str
    rank: int
    engines: list[str]
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    def codes(self, engine: str | None = None, severity: str | None = None) -> set[str]:
        return {f.code for f in self.findings if engine in (None, f.engine) and severity in (None, f.severity)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "arch": self.arch,
            "adapter": self.adapter,
            "layout": self.layout,
            "rank": self.rank,
            "engines": self.engines,
            "exit_code": self.exit_code,
            "findings": [asdict(f) for f in self.findings],
        }


# -- checks --------------------------------------------------------------------------------------------------------
# Checks for every engine ("all": the adapter does not fit the model), then each engine's declared defects
# (lpdiff.engines.capabilities), each tested by the detector of its id below.


def _convert_cmd(facts: Facts, to: str) -> str:
    from lpdiff.harness.spec.adapters import convert_command

    return convert_command(facts.model_ref, facts.info.path, to)


def check_adapter_files(f: Facts) -> list[Finding]:
    """What the validation layer finds for every engine (a run refuses the errors: exit 2): another architecture,
    no tensors, NaN/Inf, shapes or ranks that do not fit, targets naming nothing or without tensors; plus tensors
    that are not plain LoRA A/B weights (vLLM and SGLang refuse them)."""
    out = [Finding("all", p.severity, p.code, p.what, p.fix) for p in f.problems]
    if f.foreign_keys:
        out.append(
            Finding(
                "all",
                "error",
                "not-plain-lora",
                f"{len(f.foreign_keys)} tensor(s) are not LoRA A/B weights (e.g. {f.foreign_keys[0]}): "
                "DoRA magnitudes, biases or modules_to_save, which vLLM and SGLang refuse",
                "save a plain LoRA adapter (no use_dora, lora_bias or modules_to_save)",
            )
        )
    return out


def check_expert_count(f: Facts) -> list[Finding]:
    """An expert adapter for another expert count misreads every expert slice."""
    n = f.info.num_experts
    if n is None or not f.num_experts or n == f.num_experts:
        return []
    return [
        Finding(
            "all",
            "error",
            "expert-count",
            f"the adapter has {n} experts' weights, the model {f.num_experts} experts",
            "generate the adapter for this model",
        )
    ]


def check_ranks(f: Facts, engines: Sequence[str]) -> list[Finding]:
    """Ranks above what an engine can hold: its largest max_lora_rank, or the max the user runs it with."""
    out, r = [], f.max_rank
    for engine in engines:
        caps = capabilities(engine)
        if caps.max_rank is not None and r > caps.max_rank:
            out.append(
                Finding(
                    engine,
                    "error",
                    "rank-above-max",
                    f"adapter rank {r} exceeds {caps.label}'s largest max_lora_rank {caps.max_rank}",
                    f"re-train or truncate the adapter to rank <= {caps.max_rank}",
                )
            )
    for engine, limit in f.limits.items():
        if r > limit:
            out.append(
                Finding(
                    engine,
                    "error",
                    "rank-above-max",
                    f"adapter rank {r} exceeds {engine}'s max_lora_rank {limit}: the adapter is refused",
                    f"start {engine} with max_lora_rank >= {r} (lpdiff's engines size it from the adapters by default)",
                )
            )
    return out


def check_engine_defects(f: Facts, engine: str, verdict: str | None = None) -> list[Finding]:
    """The engine's declared defects for this arch and layout (and ``verdict``: "prefill" or "decode"; None: every
    verdict) whose detector finds them in this adapter. A defect that depends on what the files cannot show (the TP
    size, the batch) has no detector and is not reported."""
    caps, out = capabilities(engine), []
    common = {
        "arch": f.arch,
        **{f"to_{lay}": _convert_cmd(f, lay) for lay in ("peft3d", "per_expert", "per_expert_gate")},
    }
    for d in caps.defects(f.arch, f.info.layout, verdict=verdict):
        if d.tp or d.id not in DETECTORS or (fields := DETECTORS[d.id](f, caps)) is None:
            continue
        what, fix = d.message(**common, **fields)
        out.append(Finding(engine, d.severity, d.id, what, fix))
    return out


# -- entry points ---------------------------------------------------------------------------------------------------


def doctor(
    model,
    adapter_dir: str | Path,
    engines: Sequence[str] | None = None,
    limits: dict[str, int] | None = None,
    verdict: str | None = None,
) -> DoctorReport:
    """model: a ModelSpec, a catalog name, a checkpoint directory or a Hub id; adapter_dir: a PEFT directory, a zoo
    adapter name or a Hub repo (resolve_adapter); engines: a subset of ENGINES (default all); limits: engine -> the
    max_lora_rank it will be started with; verdict: the defects of prefill or decode verdicts only (None: both)."""
    engines = _known(engines)
    adapter_dir = resolve_adapter(model, adapter_dir)
    spec = _resolve_model(model)
    ref = str(model) if isinstance(model, (str, Path)) else spec.name
    return examine(spec, adapter_dir, engines, limits, ref, verdict)


def _known(engines: Sequence[str] | None) -> list[str]:
    engines = list(engines or ENGINES)
    for e in engines:
        if e not in ENGINES:
            raise InputError(f"doctor knows engines {', '.join(ENGINES)}, not {e!r}")
    return engines


def examine(
    spec,
    adapter_dir: str | Path,
    engines: Sequence[str] | None = None,
    limits: dict[str, int] | None = None,
    model_ref: str = "",
    verdict: str | None = None,
) -> DoctorReport:
    """``doctor`` on a model and adapter already resolved (a ModelSpec, a PEFT directory): what the doctor stage of
    a run asks (``refusals``), where nothing is resolved again."""
    engines = _known(engines)
    if verdict is not None and verdict not in VERDICTS:
        raise InputError(f"doctor judges verdicts {', '.join(VERDICTS)}, not {verdict!r}")
    facts = gather(spec, adapter_dir, limits, model_ref)
    findings = [
        *check_adapter_files(facts),
        *check_noop(facts),
        *check_expert_count(facts),
        *check_ranks(facts, engines),
        *(x for e in engines for x in check_engine_defects(facts, e, verdict)),
    ]
    findings = [x for x in findings if x.engine in (*engines, "all")]
    rank = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda x: (rank[x.severity], x.engine))
    return DoctorReport(
        model=spec.name,
        arch=facts.arch,
        adapter=str(adapter_dir),
        layout=facts.info.layout,
        rank=facts.max_rank,
        engines=engines,
        findings=findings,
    )


class Refusals(NamedTuple):
    errors: list[Finding]  # the engine refuses the adapter, dies on it, or computes something else with it
    warnings: list[Finding]  # it may


def refusals(spec, adapter_dir: str | Path, engine: str, verdict: str = "prefill") -> Refusals:
    """The doctor's findings that hold for ``engine`` on this adapter in a ``verdict`` ("prefill": the engine's
    prompt logprobs; "decode": its sampled ones): its own, and those of every engine ("all": the adapter does not fit
    the model). For an engine whose adapter handling the doctor does not know (triton reads every layout), the "all"
    findings alone. The one place that decides what stops a run: preflight, check, the metamorphic relations (prefill)
    and the decode verdicts read it."""
    findings = examine(spec, adapter_dir, [engine] if engine in ENGINES else [ENGINES[0]], verdict=verdict).findings
    mine = [f for f in findings if f.engine in (engine, "all")]
    return Refusals([f for f in mine if f.severity == "error"], [f for f in mine if f.severity == "warning"])
