"""``lpdiff doctor MODEL ADAPTER [--engine E]``: the doctor stage's findings (harness/pipeline/doctor.py) as a report,
one line each with the fix; exit code 1 when something will break."""

from __future__ import annotations

# the stage's entry point and engine lists, for the CLI that prints this report
from lpdiff.harness.pipeline.doctor import ENGINES, RANK_LIMITED, DoctorReport, doctor

__all__ = ["ENGINES", "RANK_LIMITED", "doctor", "format_report"]


def format_report(report: DoctorReport) -> str:
    head = f"lpdiff doctor: {report.model} ({report.arch}) + {report.adapter} (rank {report.rank}, {report.layout})"
    lines = [head]
    for f in report.findings:
        lines.append(f"  {f.engine:<7} {f.severity.upper():<8} {f.message}")
        lines.append(f"  {'':<7} {'':<8} fix: {f.fix}")
    lines.extend(
        f"  {e:<7} OK"
        for e in report.engines
        if not any(f.engine in (e, "all") and f.severity != "info" for f in report.findings)
    )
    errors = sum(f.severity == "error" for f in report.findings)
    warnings = sum(f.severity == "warning" for f in report.findings)
    lines.append(f"{errors} error(s), {warnings} warning(s): exit {report.exit_code}")
    return "\n".join(lines)
