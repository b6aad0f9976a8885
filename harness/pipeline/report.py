"""The one writer of each output form: text tables (tabulate), CSV rows (appended, header once) and JSON files.
Commands build rows; nothing else formats them."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tabulate import tabulate

from lpdiff.harness.pipeline.verdict import Verdict

LANE_COLUMNS = ("model", "engine pair", "dtype", "TP", "adapter")  # what names a lane, in every table of lanes
VERDICT_HEADERS = (
    *LANE_COLUMNS,
    "k2",
    "max |Δ|",
    "Δ fidelity",
    "near-tie",
    "threshold",
    "expected",
    "verdict",
    "reason",
    "next step",
)
# The default table fits ~120 columns (a default run's rows are ~95 wide): columns every row shares (engine pair,
# dtype, expected outcome) go to one line above it, reasons and next steps to lines below it; ``wide`` (or the JSON
# of --json) keeps everything in the rows.
COMPACT_HEADERS = ("model", "TP", "adapter", "k2", "max |Δ|", "Δ fid", "tie", "thr", "verdict")
SHARED = {"engine pair": 1, "dtype": 2, "expected": 10}  # hoistable column -> its index in verdict_rows
WIDTH = 120
_SOURCE = {"measured": "meas", "unmeasured": "unmeas"}
_MATCH = {"exact": "", "other-tp": "~tp", "default": "~dflt"}


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table for terminals and PR descriptions."""
    return tabulate(
        [[("-" if c is None else c) for c in r] for r in rows],
        headers=list(headers),
        tablefmt="simple",
        disable_numparse=True,
    )


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def fidelity_cell(f: float | Mapping[str, float] | None) -> str:
    if isinstance(f, Mapping):
        if not f:
            return "-"
        group, worst = max(f.items(), key=lambda kv: kv[1] if not math.isnan(kv[1]) else math.inf)
        return f"{worst:.3g} [{group}]"
    return _g(f)


class Judged(Protocol):
    """A judged lane: a prefill Verdict, or a decode lane (harness/commands/decode.py DecodeLane)."""

    @property
    def passed(self) -> bool: ...


def outcome(v: Judged) -> str:
    """PASS / FAIL, and whether that is what the lane expected (a bug-zoo fault or known defect must FAIL)."""
    got = "PASS" if v.passed else "FAIL"
    expected = getattr(v, "expected", None) or "PASS"
    return got if got == expected else f"{got} (unexpected)"


def threshold_cell(v: Verdict) -> str:
    """ "meas" / "unmeas", with "~tp" or "~dflt" when the lookup fell back to another TP's or the dtype's default."""
    t = v.threshold
    return _SOURCE.get(t.source, t.source) + _MATCH.get(t.match, f"~{t.match}")


def verdict_rows(verdicts: Sequence[Verdict]) -> list[list[str]]:
    return [
        [
            v.model,
            v.engine_pair,
            v.dtype,
            str(v.tp),
            v.adapter or "-",
            _g(v.metrics.k2),
            _g(v.metrics.max_abs),
            fidelity_cell(v.delta_fidelity),
            "-" if v.near_tie_share is None else f"{v.near_tie_share:.1%}",
            v.threshold.provenance,
            getattr(v, "expected", None) or "PASS",
            outcome(v),
            "; ".join(v.reasons),
            getattr(v, "next_step", "") or "-",
        ]
        for v in verdicts
    ]


def _github(rows: list[list[Any]], headers: list[str]) -> tuple[list[list[str]], list[str]]:
    # a bare | in a cell ("max |Δ|") would split a markdown table's column
    return [[str(c).replace("|", "\\|") for c in r] for r in rows], [h.replace("|", "\\|") for h in headers]


def verdict_table(verdicts: Sequence[Verdict], fmt: str = "simple", wide: bool = False) -> str:
    """``fmt``: a tabulate format ("simple" for terminals, "github" for markdown such as a CI step summary).
    Default: the compact table (COMPACT_HEADERS) with shared columns above and each unexpected lane's reasons and
    next step below; ``wide``: every column (VERDICT_HEADERS) in the rows."""
    full = [[("-" if c is None else c) for c in r] for r in verdict_rows(verdicts)]
    if wide:
        rows, headers = full, list(VERDICT_HEADERS)
        if fmt == "github":
            rows, headers = _github(rows, headers)
        return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
    shared = {h: full[0][i] for h, i in SHARED.items() if full and len({r[i] for r in full}) == 1}
    headers = list(COMPACT_HEADERS)
    if "engine pair" not in shared or "dtype" not in shared:
        headers.insert(1, "engine")
    if "expected" not in shared:
        headers.insert(len(headers) - 1, "expect")
    rows = []
    for v, r in zip(verdicts, full):
        cells = {
            "model": r[0],
            "engine": r[1],
            "TP": r[3],
            "adapter": r[4],
            "k2": r[5],
            "max |Δ|": r[6],
            "Δ fid": r[7],
            "tie": r[8],
            "thr": threshold_cell(v),
            "expect": r[10],
            "verdict": r[11],
        }
        rows.append([cells[h] for h in headers])
    if fmt == "github":
        rows, headers = _github(rows, headers)
    above = ", ".join(f"{h} {val}" for h, val in shared.items() if h != "dtype")
    lines = [above] if above and fmt != "github" else []
    lines.append(tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True))
    return "\n".join(lines + _below(verdicts, fmt))


def _below(verdicts: Sequence[Verdict], fmt: str) -> list[str]:
    """Each unexpected lane's reasons, then every distinct next step once (TP 2's lanes share one bisect)."""
    import textwrap

    out, steps = [], []
    if any(v.threshold.source != "measured" for v in verdicts):
        out += textwrap.wrap(
            "thr: unmeas = an unmeasured default threshold (no noise floor behind it; `lpdiff "
            "calibrate` measures one); ~tp / ~dflt: another TP's entry / the dtype's default",
            WIDTH,
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    for v in verdicts:
        if outcome(v).endswith("(unexpected)"):
            head = f"{outcome(v)} {v.model} tp={v.tp} {v.adapter or '-'}: "
            out += textwrap.wrap(
                head + ("; ".join(v.reasons) or "it passed"), WIDTH, subsequent_indent="    ", break_on_hyphens=False
            )
            if getattr(v, "next_step", "") and v.next_step not in steps:
                steps.append(v.next_step)
    out += [f"next step: {s}" for s in steps]
    return [f"{line}  " if fmt == "github" else line for line in out]  # markdown: two spaces keep line breaks


def verdict_summary(verdicts: Sequence[Verdict]) -> str:
    """One line: how many verdicts came out as expected (a bug-zoo lane that FAILs is as expected)."""
    unexpected = [v for v in verdicts if outcome(v).endswith("(unexpected)")]
    return f"{len(verdicts)} verdicts: {len(verdicts) - len(unexpected)} as expected, {len(unexpected)} not"


def append_csv(path: str | Path, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    """Append rows to a CSV (header written when the file is new); columns a row lacks stay empty. A file whose
    header is not ``columns`` is refused before anything is written (rows of more columns under a shorter header
    would be misread), naming the command that adds the missing columns where its header is their prefix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        _refuse_another_header(path, list(columns))
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="raise")
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def _refuse_another_header(path: Path, columns: list[str]) -> None:
    import shlex

    from lpdiff.harness.spec.errors import InputError

    with path.open(newline="") as f:
        have = f.readline().rstrip("\r\n").split(",")
    if have == columns:
        return
    missing = [c for c in columns if c not in have]
    fix = (  # csv writes CRLF line ends: the new columns go before a line's \r
        f"add the column(s) to its header: sed -i -E '1s/(\\r?)$/,{','.join(missing)}\\1/' {shlex.quote(str(path))}"
        if have == columns[: len(have)]
        else "write to a new file"
    )
    raise InputError(f"{path}: its header is not lpdiff's columns for it ({', '.join(missing)} missing); {fix}")


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    return path
