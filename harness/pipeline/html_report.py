"""One self-contained HTML page from verdict JSON documents (``verdict.to_json``): inline CSS, JS and SVG, no network.

The newest document gives the verdict table (with the *expected* column: a lane that must FAIL and fails reads
"expected FAIL", apart from an unexpected FAIL and from an expected FAIL that passed, which means a fault went
unseen), one panel per lane (|d| along each prompt's positions with router near-ties marked, the histogram of d,
and noise / threshold / measured k2 on one log axis) and the metamorphic matrix (engine x relation -> verdict).
Given several documents (several nights), each lane's k2 over time. Plots are hand-written SVG: a few lines each,
so the report needs no plotting library and opens anywhere.
"""
from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lpdiff.harness.pipeline.verdict import load_document

W, H, PAD = 360, 140, 34  # plot size in px and the margin left for axis labels
_TIE = "#e8890c"
_LINE = "#3060c0"

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
.controls{margin:8px 0}label{margin-right:12px}
"""

JS = """
function filt(){const only=document.getElementById('only-bad').checked;
 document.querySelectorAll('tr.row').forEach(r=>{r.style.display=(only&&!r.classList.contains('bad'))?'none':''});
 document.querySelectorAll('div.lane').forEach(r=>{r.style.display=(only&&!r.classList.contains('bad'))?'none':''});}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: Any) -> float | None:
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _fmt(x: Any) -> str:
    v = _num(x)
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


# -- SVG ------------------------------------------------------------------------------------------------------
def _svg(body: str, w: int = W, h: int = H, title: str = "") -> str:
    t = f'<text x="{w / 2}" y="11" text-anchor="middle" font-weight="600">{_e(title)}</text>' if title else ""
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{t}{body}</svg>'


class _Log:
    """A log10 axis over [lo, hi] mapped to pixels [p0, p1]; values <= 0 sit at lo."""

    def __init__(self, values: Iterable[float], p0: float, p1: float, floor: float = 1e-12):
        vs = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        lo, hi = (min(vs), max(vs)) if vs else (floor, 1.0)
        self.lo, self.hi = math.floor(math.log10(max(lo, floor))), math.ceil(math.log10(max(hi, floor)))
        if self.hi <= self.lo:
            self.hi = self.lo + 1
        self.p0, self.p1 = p0, p1

    def __call__(self, v: float) -> float:
        x = math.log10(v) if v and math.isfinite(v) and v > 0 else self.lo
        x = min(max(x, self.lo), self.hi)
        return self.p0 + (x - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)

    def ticks(self) -> list[int]:
        step = max(1, math.ceil((self.hi - self.lo) / 5))
        return list(range(self.lo, self.hi + 1, step))


def _y_log_axis(y: _Log, w: int) -> str:
    out = []
    for t in y.ticks():
        py = y(10.0 ** t)
        out.append(f'<line x1="{PAD}" x2="{w - 6}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>'
                   f'<text x="{PAD - 3}" y="{py + 3:.1f}" text-anchor="end">1e{t}</text>')
    return "".join(out)


def positions_svg(detail: Mapping[str, Any]) -> str:
    """|d| along positions, prompts one after another (grey separators), near-tie positions as orange ticks."""
    prompts = detail.get("prompts") or []
    ds = [abs(_num(x) or 0.0) for p in prompts for x in p["d"]]
    if not ds:
        return _svg('<text x="10" y="70">no per-position detail</text>', title="|d| along positions")
    y = _Log(ds, H - 18, 16)
    n = len(ds)
    x = lambda i: PAD + i / max(n - 1, 1) * (W - PAD - 6)
    parts, i0 = [_y_log_axis(y, W)], 0
    for p in prompts:
        vals = [abs(_num(v) or 0.0) for v in p["d"]]
        if i0:
            parts.append(f'<line x1="{x(i0):.1f}" x2="{x(i0):.1f}" y1="16" y2="{H - 18}" stroke="#ccc"/>')
        for j in p.get("near_tie") or []:
            parts.append(f'<line class="tie" x1="{x(i0 + j):.1f}" x2="{x(i0 + j):.1f}" y1="{H - 18}" y2="{H - 12}" '
                         f'stroke="{_TIE}" stroke-width="1.5"/>')
        pts = " ".join(f"{x(i0 + j):.1f},{y(v):.1f}" for j, v in enumerate(vals))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{_LINE}" stroke-width="1"/>')
        i0 += len(vals)
    shown = f"{n} of {detail.get('num_positions', n)} positions"
    parts.append(f'<text x="{W - 6}" y="{H - 2}" text-anchor="end">{shown}; ticks = near-tie</text>')
    return _svg("".join(parts), title="|d| along positions (log)")


def histogram_svg(detail: Mapping[str, Any]) -> str:
    hist = detail.get("hist") or {}
    counts, edges = hist.get("counts") or [], [(_num(e) or 0.0) for e in hist.get("edges") or []]
    if not counts:
        return _svg('<text x="10" y="70">no histogram</text>', title="histogram of d")
    top = max(counts) or 1
    bw = (W - PAD - 6) / len(counts)
    bars = "".join(f'<rect x="{PAD + i * bw:.1f}" y="{H - 18 - c / top * (H - 40):.1f}" width="{max(bw - 1, 1):.1f}" '
                   f'height="{c / top * (H - 40):.1f}" fill="{_LINE}"><title>{edges[i]:.3g}..{edges[i + 1]:.3g}: '
                   f'{c}</title></rect>' for i, c in enumerate(counts))
    axis = (f'<text x="{PAD}" y="{H - 4}">{edges[0]:.2g}</text><text x="{W - 6}" y="{H - 4}" text-anchor="end">'
            f'{edges[-1]:.2g}</text><text x="{PAD - 3}" y="24" text-anchor="end">{top}</text>')
    return _svg(bars + axis, title="histogram of d (all positions)")


def scale_svg(v: Mapping[str, Any]) -> str:
    """Noise floor, threshold and the measured k2 of one lane on one log axis."""
    t, m = v["threshold"], v["metrics"]
    marks = [("noise", _num(t.get("noise_k2")), "#888"), ("threshold", _num(t.get("k2")), "#b71c1c"),
             ("k2", _num(m.get("k2")), _LINE)]
    x = _Log([val for _, val, _ in marks], PAD, W - 12)
    parts = [f'<line x1="{PAD}" x2="{W - 12}" y1="70" y2="70" stroke="#999"/>']
    for tick in x.ticks():
        px = x(10.0 ** tick)
        parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="66" y2="74" stroke="#999"/>'
                     f'<text x="{px:.1f}" y="88" text-anchor="middle">1e{tick}</text>')
    for row, (label, val, color) in enumerate(marks):
        if val is None or math.isnan(val):
            parts.append(f'<text x="{PAD}" y="{112 + row * 11}" fill="#999">{label}: n/a</text>')
            continue
        px = x(val)
        parts.append(f'<circle cx="{px:.1f}" cy="70" r="5" fill="{color}"><title>{label} {val:.3g}</title></circle>'
                     f'<text x="{min(max(px, PAD + 30), W - 40):.1f}" y="{50 - row * 11}" text-anchor="middle" '
                     f'fill="{color}">{label} '
                     f'{val:.2g}</text>')
    return _svg("".join(parts), title="k2: noise · threshold · measured")


def history_svg(points: Sequence[tuple[str, float | None, float | None]]) -> str:
    """k2 per night (date, k2, threshold k2), log y; the threshold dashed."""
    ys = [k for _, k, _ in points] + [t for _, _, t in points]
    y = _Log(ys, H - 22, 16)
    n = len(points)
    x = lambda i: PAD + 8 + i / max(n - 1, 1) * (W - PAD - 24)
    parts = [_y_log_axis(y, W)]
    for key, color, dash in ((2, "#b71c1c", ' stroke-dasharray="4 3"'), (1, _LINE, "")):
        pts = " ".join(f"{x(i):.1f},{y(p[key]):.1f}" for i, p in enumerate(points) if p[key] is not None)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}"{dash}/>')
    for i, (date, k, _) in enumerate(points):
        if k is not None:
            parts.append(f'<circle cx="{x(i):.1f}" cy="{y(k):.1f}" r="3" fill="{_LINE}"><title>{_e(date)}: k2 '
                         f'{k:.3g}</title></circle>')
    parts.append(f'<text x="{PAD}" y="{H - 4}">{_e(points[0][0][:10])}</text><text x="{W - 6}" y="{H - 4}" '
                 f'text-anchor="end">{_e(points[-1][0][:10])}</text>')
    return _svg("".join(parts), title="k2 per night (threshold dashed)")


# -- page -----------------------------------------------------------------------------------------------------
def _table(verdicts: Sequence[Mapping[str, Any]]) -> str:
    head = ("lane", "model", "engine pair", "dtype", "TP", "adapter", "k2", "max |d|", "threshold k2",
            "near-tie", "expected", "verdict", "reasons")
    rows = []
    for i, v in enumerate(verdicts):
        cls, label = outcome(v)
        m, t = v["metrics"], v["threshold"]
        share = _num(v.get("near_tie_share"))
        bad = " bad" if cls in ("fail", "xpass") else ""
        cells = [f'<a href="#lane-{i}">{i}</a>', _e(v["model"]), _e(v["engine_pair"]), _e(v["dtype"]), _e(v["tp"]),
                 _e(v.get("adapter") or "-"), _fmt(m.get("k2")), _fmt(m.get("max_abs")), _fmt(t.get("k2")),
                 "-" if share is None else f"{share:.1%}", _e(v.get("expected", "PASS")),
                 f'<span class="st {cls}">{label}</span>', _e("; ".join(v.get("reasons") or []))]
        rows.append(f'<tr class="row {cls}{bad}" data-outcome="{cls}">' + "".join(
            f'<td class="num">{c}</td>' if j in (6, 7, 8, 9) else f"<td>{c}</td>" for j, c in enumerate(cells))
            + "</tr>")
    return ('<table id="verdicts"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _metamorphic(reports: Sequence[Mapping[str, Any]]) -> str:
    relations = sorted({r["relation"] for rep in reports for r in rep.get("results", [])})
    head = "<tr><th>engine · model · dtype</th>" + "".join(f"<th>{_e(r)}</th>" for r in relations) + "</tr>"
    rows = []
    for rep in reports:
        by = {r["relation"]: r for r in rep.get("results", [])}
        cells = []
        for rel in relations:
            r = by.get(rel)
            verdict = r["verdict"] if r else "n/a"
            cls = {"PASS": "pass", "FAIL": "fail"}.get(verdict, "na")
            tip = _e(r.get("note", "")) if r else ""
            cells.append(f'<td title="{tip}"><span class="st {cls}">{_e(verdict)}</span></td>')
        name = f"{rep.get('engine')} · {rep.get('model')} · {rep.get('dtype')}"
        rows.append(f"<tr><td>{_e(name)}</td>{''.join(cells)}</tr>")
    return f'<table id="metamorphic">{head}{"".join(rows)}</table>'


def _history(docs: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[str, float | None, float | None]]]:
    out: dict[str, list] = {}
    for doc in docs:
        for v in doc["verdicts"]:
            out.setdefault(lane_id(v), []).append((doc.get("created", "?"), _num(v["metrics"].get("k2")),
                                                   _num(v["threshold"].get("k2"))))
    return out


def render(docs: Sequence[Mapping[str, Any]], sources: Sequence[str] = ()) -> str:
    """The page for documents in time order; the last one is "tonight"."""
    latest = docs[-1]
    verdicts = latest["verdicts"]
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[outcome(v)[1]] = counts.get(outcome(v)[1], 0) + 1
    history = _history(docs) if len(docs) > 1 else {}
    summary = "".join(f'<span><span class="st {cls}">{label}</span> {counts.get(label, 0)}</span>'
                      for cls, label in (("pass", "PASS"), ("fail", "FAIL"), ("xfail", "expected FAIL"),
                                         ("xpass", "unexpected PASS")))
    lanes = []
    for i, v in enumerate(verdicts):
        cls, label = outcome(v)
        plots = [positions_svg(v.get("detail") or {}), histogram_svg(v.get("detail") or {}), scale_svg(v)]
        if len(history.get(lane_id(v), [])) > 1:
            plots.append(history_svg(history[lane_id(v)]))
        reasons = "".join(f'<div class="reason">{_e(r)}</div>' for r in v.get("reasons") or [])
        bad = " bad" if cls in ("fail", "xpass") else ""
        lanes.append(f'<div class="lane{bad}" id="lane-{i}"><h3>{i}. {_e(lane_id(v))} <span class="st {cls}">'
                     f'{label}</span></h3>{reasons}<div class="plots">{"".join(plots)}</div></div>')
    meta = (f"{len(verdicts)} lanes · lpdiff {_e(latest.get('lpdiff_version', '?'))} · created "
            f"{_e(latest.get('created', '?'))}" + (f" · {len(docs)} runs: k2 over time in each lane" if history else ""))
    meta += "".join(f"<br>{_e(s)}" for s in sources)
    metamorphic = latest.get("metamorphic") or []
    meta_html = f"<h2>Metamorphic relations</h2>{_metamorphic(metamorphic)}" if metamorphic else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>lpdiff report</title>'
            f"<style>{CSS}</style><script>{JS}</script></head><body><h1>lpdiff report</h1>"
            f'<div class="meta">{meta}</div><div class="summary">{summary}</div>'
            f'<div class="controls"><label><input type="checkbox" id="only-bad" onchange="filt()"> only unexpected '
            f"outcomes</label></div><h2>Verdicts</h2>{_table(verdicts)}{meta_html}<h2>Lanes</h2>"
            f'<div class="lanes">{"".join(lanes)}</div></body></html>')


def write_report(json_paths: Sequence[str | Path], out_html: str | Path) -> Path:
    """Read verdict documents (any schema version this lpdiff knows), order them by their ``created`` stamp and
    write the page. ValueError naming the file when one is not a verdict document."""
    docs = []
    for p in json_paths:
        try:
            docs.append(load_document(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: cannot read it as lpdiff verdict JSON ({e}); pass files written by "
                             "`lpdiff run --json` or the pytest plugin") from e
    if not docs:
        raise ValueError("no verdict JSON given: pass at least one file")
    order = sorted(range(len(docs)), key=lambda i: (docs[i].get("created") or "", i))
    out = Path(out_html)
    out.write_text(render([docs[i] for i in order], [str(json_paths[i]) for i in order]))
    return out

