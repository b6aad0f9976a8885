"""The one writer of each output form: text tables (tabulate), CSV rows (appended, header once) and JSON files.
Commands build rows; nothing else formats them."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tabulate import tabulate

from lpdiff.harness.pipeline.verdict import Verdict

VERDICT_HEADERS = ("model", "engine pair", "dtype", "TP", "adapter", "k2", "max |Δ|", "Δ fidelity", "near-tie",
                   "threshold", "expected", "verdict", "reason")


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table for terminals and PR descriptions."""
    return tabulate([[("-" if c is None else c) for c in r] for r in rows], headers=list(headers),
                    tablefmt="simple", disable_numparse=True)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def fidelity_cell(f: float | Mapping[str, float] | None) -> str:
    if isinstance(f, Mapping):
        if not f:
            return "-"
        group, worst = max(f.items(), key=lambda kv: kv[1] if not math.isnan(kv[1]) else math.inf)
        return f"{worst:.3g} [{group}]"
    return _g(f)


def outcome(v: Verdict) -> str:
    """PASS / FAIL, and whether that is what the lane expected (a bug-zoo fault or known defect must FAIL)."""
    got = "PASS" if v.passed else "FAIL"
    expected = getattr(v, "expected", None) or "PASS"
    return got if got == expected else f"{got} (unexpected)"


def verdict_rows(verdicts: Sequence[Verdict]) -> list[list[str]]:
    return [[v.model, v.engine_pair, v.dtype, str(v.tp), v.adapter or "-", _g(v.metrics.k2), _g(v.metrics.max_abs),
             fidelity_cell(v.delta_fidelity), "-" if v.near_tie_share is None else f"{v.near_tie_share:.1%}",
             v.threshold.provenance, getattr(v, "expected", None) or "PASS", outcome(v), "; ".join(v.reasons)]
            for v in verdicts]


def verdict_table(verdicts: Sequence[Verdict], fmt: str = "simple") -> str:
    """``fmt``: a tabulate format ("simple" for terminals, "github" for markdown such as a CI step summary)."""
    rows = [[("-" if c is None else c) for c in r] for r in verdict_rows(verdicts)]
    headers = list(VERDICT_HEADERS)
    if fmt == "github":  # a bare | in a cell ("max |Δ|") would split a markdown table's column
        rows = [[str(c).replace("|", "\\|") for c in r] for r in rows]
        headers = [h.replace("|", "\\|") for h in headers]
    return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)


def verdict_summary(verdicts: Sequence[Verdict]) -> str:
    """One line: how many verdicts came out as expected (a bug-zoo lane that FAILs is as expected)."""
    unexpected = [v for v in verdicts if outcome(v).endswith("(unexpected)")]
    return f"{len(verdicts)} verdicts: {len(verdicts) - len(unexpected)} as expected, {len(unexpected)} not"


def append_csv(path: str | Path, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    """Append rows to a CSV (header written when the file is new); columns a row lacks stay empty."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="raise")
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    return path
