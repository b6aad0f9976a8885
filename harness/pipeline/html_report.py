"""One self-contained HTML page from verdict JSON documents (``verdict.to_json``): inline CSS, JS and SVG, no network.

The newest document gives the verdict table (with the *expected* column: a lane that must FAIL and fails reads
"expected FAIL", apart from an unexpected FAIL and from an expected FAIL that passed, which means a fault went
unseen), one panel per lane (|d| along each prompt's positions with router near-ties marked, the histogram of d,
and noise / threshold / measured k2 on one log axis) and the metamorphic matrix (engine x relation -> verdict).
Given several documents (several nights), each lane's k2 over time, and every lane an earlier night judged that the
newest did not, as "absent in newest night". The table says which thresholds are unmeasured defaults (a banner
too), shows delta fidelity, and names each unexpected lane's next step (the bisect command for a triton FAIL).
Inputs are checked field by field (``read_document``): a bad file is one error naming it (exit 2). The plots are
hand-written SVG (html_plots.py).
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lpdiff.harness.pipeline.html_plots import esc, histogram_svg, history_svg, num, positions_svg, scale_svg
from lpdiff.harness.pipeline.report import LANE_COLUMNS
from lpdiff.harness.pipeline.routing import routing_html
from lpdiff.harness.pipeline.verdict import SCHEMA_VERSION, next_step
from lpdiff.harness.spec.errors import InputError

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}.meta{color:#666;margin-bottom:12px}
table{border-collapse:collapse;background:#fff}th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;
vertical-align:top}th{background:#eee;position:sticky;top:0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.st{font-weight:600;border-radius:4px;padding:1px 6px;white-space:nowrap}
.pass{background:#d9f2dc;color:#1b5e20}.xfail{background:#e3e6ee;color:#37474f}.fail{background:#f8d3d3;color:#b71c1c}
.xpass{background:#ffe7c2;color:#8a4b00}.na{background:#eee;color:#777}
.summary span{margin-right:14px}.lanes{display:flex;flex-wrap:wrap;gap:14px}
.lane{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 10px;width:1120px}
.lane h3{font-size:14px;margin:0 0 6px}.plots{display:flex;gap:12px;flex-wrap:wrap}
svg{background:#fff}svg text{font:10px system-ui,sans-serif;fill:#444}.reason{color:#b71c1c;font-size:12px}
.controls{margin:8px 0}label{margin-right:12px}.unmeasured{background:#fff4d6}.banner{background:#fff4d6;
border:1px solid #e8c46a;border-radius:4px;padding:6px 10px;margin:8px 0}code{font-size:12px}
"""

JS = """
function filt(){const only=document.getElementById('only-bad').checked;
 document.querySelectorAll('tr.row').forEach(r=>{r.style.display=(only&&!r.classList.contains('bad'))?'none':''});
 document.querySelectorAll('div.lane').forEach(r=>{r.style.display=(only&&!r.classList.contains('bad'))?'none':''});}
"""


def _fmt(x: Any) -> str:
    v = num(x)
    return "-" if v is None else f"{v:.3g}"


def lane_id(v: Mapping[str, Any]) -> str:
    return f"{v['model']} · {v['engine_pair']} · {v['dtype']} · TP {v['tp']} · {v.get('adapter') or 'no adapter'}"


def outcome(v: Mapping[str, Any]) -> tuple[str, str]:
    """(css class, label): an expected FAIL is not an error; an expected FAIL that passed is (the fault went
    unseen)."""
    expected = v.get("expected", "PASS")
    if v["passed"]:
        return ("pass", "PASS") if expected == "PASS" else ("xpass", "unexpected PASS")
    return ("xfail", "expected FAIL") if expected == "FAIL" else ("fail", "FAIL")


# -- page -----------------------------------------------------------------------------------------------------
def threshold_text(t: Mapping[str, Any]) -> tuple[str, bool]:
    """(what a threshold is, whether it is an unmeasured guess): "measured" = a noise floor x factor; anything else
    is said in words, with the fallback lookup() used."""
    source, match = t.get("source", "?"), t.get("match", "exact")
    if source == "case":
        return "the case's kl_v2 threshold", False
    what = {"measured": "measured noise x factor", "unmeasured": "unmeasured default"}.get(source, source)
    if match == "other-tp":
        what += " (another TP's entry)"
    elif match == "default":
        what += " (the dtype's default)"
    return what, source != "measured"


def _next(v: Mapping[str, Any]) -> str:
    """The lane's own next step, else one derived from its fields (documents written before verdicts carried it)."""
    if v.get("next_step"):
        return v["next_step"]
    if v.get("case") or "-vs-" not in str(v.get("engine_pair", "")):
        return ""
    return next_step(v["engine_pair"], v["model"], v.get("adapter"), v.get("tp"))


def _table(verdicts: Sequence[Mapping[str, Any]], absent: Sequence[tuple[Mapping[str, Any], str]] = ()) -> str:
    head = (
        "lane",
        *LANE_COLUMNS,
        "k2",
        "max |d|",
        "Δ fidelity",
        "threshold k2",
        "threshold",
        "near-tie",
        "expected",
        "verdict",
        "reasons",
        "next step",
    )
    nums = (6, 7, 8, 9, 11)
    rows = []
    for i, v in enumerate(verdicts):
        cls, label = outcome(v)
        m, t = v["metrics"], v["threshold"]
        share = num(v.get("near_tie_share"))
        bad = " bad" if cls in ("fail", "xpass") else ""
        what, guess = threshold_text(t)
        step = _next(v) if bad else ""
        cells = [
            f'<a href="#lane-{i}">{i}</a>',
            esc(v["model"]),
            esc(v["engine_pair"]),
            esc(v["dtype"]),
            esc(v["tp"]),
            esc(v.get("adapter") or "-"),
            _fmt(m.get("k2")),
            _fmt(m.get("max_abs")),
            esc(fidelity_text(v.get("delta_fidelity"))),
            _fmt(t.get("k2")),
            f'<span class="{"unmeasured" if guess else ""}">{esc(what)}</span>',
            "-" if share is None else f"{share:.1%}",
            esc(v.get("expected", "PASS")),
            f'<span class="st {cls}">{label}</span>',
            esc("; ".join(v.get("reasons") or [])),
            f"<code>{esc(step)}</code>" if step else "",
        ]
        rows.append(
            f'<tr class="row {cls}{bad}" data-outcome="{cls}">'
            + "".join(f'<td class="num">{c}</td>' if j in nums else f"<td>{c}</td>" for j, c in enumerate(cells))
            + "</tr>"
        )
    for v, seen in absent:  # lanes an earlier night judged and the newest did not: never dropped silently
        cls, label = outcome(v)
        cells = [
            "-",
            esc(v["model"]),
            esc(v["engine_pair"]),
            esc(v["dtype"]),
            esc(v["tp"]),
            esc(v.get("adapter") or "-"),
            _fmt(v["metrics"].get("k2")),
            _fmt(v["metrics"].get("max_abs")),
            esc(fidelity_text(v.get("delta_fidelity"))),
            _fmt(v["threshold"].get("k2")),
            "",
            "-",
            esc(v.get("expected", "PASS")),
            '<span class="st na">absent in newest night</span>',
            esc(
                f"last judged {seen}: {label}; the newest night has no such lane (not run, skipped, or died "
                "before its verdict)"
            ),
            "",
        ]
        rows.append(
            '<tr class="row absent bad" data-outcome="absent">'
            + "".join(f'<td class="num">{c}</td>' if j in nums else f"<td>{c}</td>" for j, c in enumerate(cells))
            + "</tr>"
        )
    return (
        '<table id="verdicts"><thead><tr>'
        + "".join(f"<th>{esc(h)}</th>" for h in head)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


def fidelity_text(f: Any) -> str:
    """One number, or the worst module group's with its name (the group lanes of a mixed batch)."""
    if isinstance(f, Mapping):
        vals = {k: v for k, v in ((k, num(x)) for k, x in f.items()) if v is not None}
        if not vals:
            return "-"
        group, worst = max(vals.items(), key=lambda kv: kv[1] if not math.isnan(kv[1]) else math.inf)
        return f"{worst:.3g} [{group}]"
    return _fmt(f)


def _metamorphic(reports: Sequence[Mapping[str, Any]]) -> str:
    relations = sorted({r["relation"] for rep in reports for r in rep.get("results", [])})
    head = "<tr><th>engine · model · dtype</th>" + "".join(f"<th>{esc(r)}</th>" for r in relations) + "</tr>"
    rows = []
    for rep in reports:
        by = {r["relation"]: r for r in rep.get("results", [])}
        cells = []
        for rel in relations:
            r = by.get(rel)
            verdict = r["verdict"] if r else "n/a"
            cls = {"PASS": "pass", "FAIL": "fail"}.get(verdict, "na")
            tip = esc(r.get("note", "")) if r else ""
            cells.append(f'<td title="{tip}"><span class="st {cls}">{esc(verdict)}</span></td>')
        name = f"{rep.get('engine')} · {rep.get('model')} · {rep.get('dtype')}"
        rows.append(f"<tr><td>{esc(name)}</td>{''.join(cells)}</tr>")
    return f'<table id="metamorphic">{head}{"".join(rows)}</table>'


def _history(docs: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[str, float | None, float | None]]]:
    out: dict[str, list] = {}
    for doc in docs:
        for v in doc["verdicts"]:
            out.setdefault(lane_id(v), []).append(
                (doc.get("created", "?"), num(v["metrics"].get("k2")), num(v["threshold"].get("k2")))
            )
    return out


def render(docs: Sequence[Mapping[str, Any]], sources: Sequence[str] = ()) -> str:
    """The page for documents in time order; the last one is "tonight"."""
    latest = docs[-1]
    verdicts = latest["verdicts"]
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[outcome(v)[1]] = counts.get(outcome(v)[1], 0) + 1
    history = _history(docs) if len(docs) > 1 else {}
    newest = {lane_id(v) for v in verdicts}
    absent: dict[str, tuple[Mapping[str, Any], str]] = {}
    for doc in docs[:-1]:  # the last night each vanished lane was judged
        for v in doc["verdicts"]:
            if lane_id(v) not in newest:
                absent[lane_id(v)] = (v, str(doc.get("created", "?")))
    guesses = [v for v in verdicts if threshold_text(v["threshold"])[1]]
    banner = ""
    if guesses:
        banner += (
            f'<div class="banner">{len(guesses)} of {len(verdicts)} lanes are judged against an unmeasured '
            "default threshold (a guess with no measured noise floor behind it; marked in the threshold "
            "column): <code>lpdiff calibrate</code> measures one</div>"
        )
    if absent:
        banner += (
            f'<div class="banner">{len(absent)} lane(s) judged in an earlier night are absent in the newest '
            "night: listed at the end of the table</div>"
        )
    summary = "".join(
        f'<span><span class="st {cls}">{label}</span> {counts.get(label, 0)}</span>'
        for cls, label in (("pass", "PASS"), ("fail", "FAIL"), ("xfail", "expected FAIL"), ("xpass", "unexpected PASS"))
    )
    if absent:
        summary += f'<span><span class="st na">absent in newest night</span> {len(absent)}</span>'
    lanes = []
    for i, v in enumerate(verdicts):
        cls, label = outcome(v)
        plots = [positions_svg(v.get("detail") or {}), histogram_svg(v.get("detail") or {}), scale_svg(v)]
        if len(history.get(lane_id(v), [])) > 1:
            plots.append(history_svg(history[lane_id(v)]))
        reasons = "".join(f'<div class="reason">{esc(r)}</div>' for r in v.get("reasons") or [])
        bad = " bad" if cls in ("fail", "xpass") else ""
        if bad and _next(v):
            reasons += f"<div>next step: <code>{esc(_next(v))}</code></div>"
        lanes.append(
            f'<div class="lane{bad}" id="lane-{i}"><h3>{i}. {esc(lane_id(v))} <span class="st {cls}">'
            f'{label}</span></h3>{reasons}<div class="plots">{"".join(plots)}</div>'
            f"{routing_html(v.get('routing'))}</div>"
        )
    meta = (
        f"{len(verdicts)} lanes · lpdiff {esc(latest.get('lpdiff_version', '?'))} · created "
        f"{esc(latest.get('created', '?'))}" + (f" · {len(docs)} runs: k2 over time in each lane" if history else "")
    )
    meta += "".join(f"<br>{esc(s)}" for s in sources)
    metamorphic = latest.get("metamorphic") or []
    meta_html = f"<h2>Metamorphic relations</h2>{_metamorphic(metamorphic)}" if metamorphic else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>lpdiff report</title>'
        f"<style>{CSS}</style><script>{JS}</script></head><body><h1>lpdiff report</h1>"
        f'<div class="meta">{meta}</div><div class="summary">{summary}</div>'
        f'<div class="controls"><label><input type="checkbox" id="only-bad" onchange="filt()"> only unexpected '
        f"outcomes</label></div>{banner}<h2>Verdicts</h2>{_table(verdicts, list(absent.values()))}{meta_html}"
        "<h2>Lanes</h2>"
        f'<div class="lanes">{"".join(lanes)}</div></body></html>'
    )


class ReportInputError(InputError):
    """A file ``lpdiff report`` cannot draw; the message names it and what is wrong with it (exit 2)."""


# what a verdict needs to be drawn: field -> the JSON types it may have
_NEEDS = {
    "model": (str,),
    "engine_pair": (str,),
    "dtype": (str,),
    "tp": (int, type(None)),
    "passed": (bool,),
    "metrics": (dict,),
    "threshold": (dict,),
}
_WRITERS = "pass a file written by `lpdiff run --json`, `lpdiff run --case --json` or pytest's --lpdiff-report"


def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(x), "a number"
    )


def _check_verdict(v: Any, i: int, path: Path) -> None:
    if not isinstance(v, dict):
        raise ReportInputError(f"{path}: verdict {i} is {_kind(v)}, not a verdict object; {_WRITERS}")
    missing = [k for k in _NEEDS if k not in v]
    wrong = [f"{k} is {_kind(v[k])}" for k, types in _NEEDS.items() if k in v and not isinstance(v[k], types)]
    wrong += [
        f"metrics has no {k}" for k in ("k2", "max_abs") if isinstance(v.get("metrics"), dict) and k not in v["metrics"]
    ]
    wrong += ["threshold has no k2" for _ in [0] if isinstance(v.get("threshold"), dict) and "k2" not in v["threshold"]]
    if missing or wrong:
        what = "; ".join(([f"lacks {', '.join(missing)}"] if missing else []) + wrong)
        raise ReportInputError(
            f"{path}: verdict {i} ({v.get('model', '?')} {v.get('engine_pair', '?')} "
            f"{v.get('adapter') or ''}) {what}: a partial or hand-edited file? {_WRITERS}"
        )


def _case_document(d: dict, path: Path) -> dict:
    """``lpdiff run --case --json``'s object (commands/case.CaseVerdict) as a one-lane verdict document: engine vs
    the trainer, judged on kl_v2 (lpdiff's k2) against the case's threshold, the case's own noise beside it."""
    missing = [k for k in ("case", "model", "engine", "dtype", "tp", "threshold", "metrics", "passed") if k not in d]
    if missing:
        raise ReportInputError(f"{path}: a trainer-case verdict lacking {', '.join(missing)}; {_WRITERS}")
    v = {
        "model": d["model"],
        "engine_pair": f"{d['engine']}:{d['dtype']}-vs-trainer",
        "dtype": d["dtype"],
        "tp": d["tp"],
        "adapter": f"case {d['case']}",
        "metrics": d["metrics"],
        "passed": d["passed"],
        "threshold": {
            "k2": d["threshold"],
            "max_abs": None,
            "delta_fidelity": None,
            "source": "case",
            "noise_k2": d.get("kl_v2_sampler_trainer"),
        },
        "delta_fidelity": None,
        "near_tie_share": None,
        "reasons": [d["reason"]] if d.get("reason") else [],
        "case": d["case"],
    }
    return {"schema_version": SCHEMA_VERSION, "verdicts": [v]}


def read_document(path: str | Path) -> dict[str, Any]:
    """A verdict document (any schema version this lpdiff reads: the object, the bare list older versions wrote,
    or a trainer case's verdict), checked field by field: ReportInputError naming the file and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg}); {_WRITERS}") from None
    if isinstance(doc, dict) and "kl_v2_engine_trainer" in doc:
        doc = _case_document(doc, path)
    elif isinstance(doc, list):
        doc = {"schema_version": 0, "verdicts": doc}
    elif not isinstance(doc, dict) or not isinstance(doc.get("verdicts"), list):
        got = f"an object with keys {sorted(doc)[:6]}" if isinstance(doc, dict) else _kind(doc)
        raise ReportInputError(
            f"{path}: not an lpdiff verdict document (a JSON object with a 'verdicts' list); got {got}; {_WRITERS}"
        )
    version = doc.get("schema_version", 0)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ReportInputError(
            f"{path}: schema_version {version!r}; this lpdiff reads up to {SCHEMA_VERSION}: upgrade lpdiff"
        )
    for i, v in enumerate(doc["verdicts"]):
        _check_verdict(v, i, path)
    meta = doc.get("metamorphic") or []
    if not isinstance(meta, list) or not all(
        isinstance(r, dict)
        and isinstance(r.get("results", []), list)
        and all(isinstance(x, dict) and "relation" in x and "verdict" in x for x in r.get("results", []))
        for r in meta
    ):
        raise ReportInputError(
            f"{path}: 'metamorphic' must be a list of reports whose results each have a "
            f"relation and a verdict; {_WRITERS}"
        )
    if not doc.get("created"):  # the list form and a case verdict carry no stamp: the file's time orders them
        doc["created"] = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc).isoformat(
            timespec="seconds"
        )
    return doc


def write_report(json_paths: Sequence[str | Path], out_html: str | Path) -> Path:
    """Read verdict documents (read_document), order them by their ``created`` stamp and write the page."""
    docs = [read_document(p) for p in json_paths]
    if not docs:
        raise ReportInputError("no verdict JSON given: pass at least one file")
    if not any(d["verdicts"] or d.get("metamorphic") for d in docs):
        raise ReportInputError(f"{', '.join(map(str, json_paths))}: no verdicts in any file; nothing to report")
    order = sorted(range(len(docs)), key=lambda i: (docs[i].get("created") or "", i))
    out = Path(out_html)
    out.write_text(render([docs[i] for i in order], [str(json_paths[i]) for i in order]))
    return out
