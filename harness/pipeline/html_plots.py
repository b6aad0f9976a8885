"""The plots of the HTML report (html_report.py): hand-written SVG, a few lines each, so that the page needs no
plotting library and opens anywhere. |d| along a lane's positions with router near-ties marked, the histogram of d,
noise / threshold / measured k2 on one log axis, and k2 over several nights."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

W, H, PAD = 360, 140, 34  # plot size in px and the margin left for axis labels
TIE = "#e8890c"
LINE = "#3060c0"


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def num(x: Any) -> float | None:
    """A JSON number, or the "nan" / "inf" / "-inf" strings a verdict document holds for those; None otherwise."""
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _svg(body: str, w: int = W, h: int = H, title: str = "") -> str:
    t = f'<text x="{w / 2}" y="11" text-anchor="middle" font-weight="600">{esc(title)}</text>' if title else ""
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">{t}{body}</svg>'


class _Log:
    """A log10 axis over [lo, hi] mapped to pixels [p0, p1]; values <= 0 sit at lo."""

    def __init__(self, values: Iterable[float | None], p0: float, p1: float, floor: float = 1e-12):
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
        py = y(10.0**t)
        out.append(
            f'<line x1="{PAD}" x2="{w - 6}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>'
            f'<text x="{PAD - 3}" y="{py + 3:.1f}" text-anchor="end">1e{t}</text>'
        )
    return "".join(out)


def positions_svg(detail: Mapping[str, Any]) -> str:
    """|d| along positions, prompts one after another (grey separators), near-tie positions as orange ticks."""
    prompts = detail.get("prompts") or []
    ds = [abs(num(x) or 0.0) for p in prompts for x in p["d"]]
    if not ds:
        return _svg('<text x="10" y="70">no per-position detail</text>', title="|d| along positions")
    y = _Log(ds, H - 18, 16)
    n = len(ds)

    def x(i: float) -> float:
        return PAD + i / max(n - 1, 1) * (W - PAD - 6)

    parts, i0 = [_y_log_axis(y, W)], 0
    for p in prompts:
        vals = [abs(num(v) or 0.0) for v in p["d"]]
        if i0:
            parts.append(f'<line x1="{x(i0):.1f}" x2="{x(i0):.1f}" y1="16" y2="{H - 18}" stroke="#ccc"/>')
        parts.extend(
            f'<line class="tie" x1="{x(i0 + j):.1f}" x2="{x(i0 + j):.1f}" y1="{H - 18}" y2="{H - 12}" '
            f'stroke="{TIE}" stroke-width="1.5"/>'
            for j in p.get("near_tie") or []
        )
        pts = " ".join(f"{x(i0 + j):.1f},{y(v):.1f}" for j, v in enumerate(vals))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{LINE}" stroke-width="1"/>')
        i0 += len(vals)
    shown = f"{n} of {detail.get('num_positions', n)} positions"
    parts.append(f'<text x="{W - 6}" y="{H - 2}" text-anchor="end">{shown}; ticks = near-tie</text>')
    return _svg("".join(parts), title="|d| along positions (log)")


def histogram_svg(detail: Mapping[str, Any]) -> str:
    hist = detail.get("hist") or {}
    counts, edges = hist.get("counts") or [], [(num(e) or 0.0) for e in hist.get("edges") or []]
    if not counts:
        return _svg('<text x="10" y="70">no histogram</text>', title="histogram of d")
    top = max(counts) or 1
    bw = (W - PAD - 6) / len(counts)
    bars = "".join(
        f'<rect x="{PAD + i * bw:.1f}" y="{H - 18 - c / top * (H - 40):.1f}" width="{max(bw - 1, 1):.1f}" '
        f'height="{c / top * (H - 40):.1f}" fill="{LINE}"><title>{edges[i]:.3g}..{edges[i + 1]:.3g}: '
        f"{c}</title></rect>"
        for i, c in enumerate(counts)
    )
    axis = (
        f'<text x="{PAD}" y="{H - 4}">{edges[0]:.2g}</text><text x="{W - 6}" y="{H - 4}" text-anchor="end">'
        f'{edges[-1]:.2g}</text><text x="{PAD - 3}" y="24" text-anchor="end">{top}</text>'
    )
    return _svg(bars + axis, title="histogram of d (all positions)")


def scale_svg(v: Mapping[str, Any]) -> str:
    """Noise floor, threshold and the measured k2 of one lane on one log axis."""
    t, m = v["threshold"], v["metrics"]
    marks = [
        ("noise", num(t.get("noise_k2")), "#888"),
        ("threshold", num(t.get("k2")), "#b71c1c"),
        ("k2", num(m.get("k2")), LINE),
    ]
    x = _Log([val for _, val, _ in marks], PAD, W - 12)
    parts = [f'<line x1="{PAD}" x2="{W - 12}" y1="70" y2="70" stroke="#999"/>']
    for tick in x.ticks():
        px = x(10.0**tick)
        parts.append(
            f'<line x1="{px:.1f}" x2="{px:.1f}" y1="66" y2="74" stroke="#999"/>'
            f'<text x="{px:.1f}" y="88" text-anchor="middle">1e{tick}</text>'
        )
    for row, (label, val, color) in enumerate(marks):
        if val is None or math.isnan(val):
            parts.append(f'<text x="{PAD}" y="{112 + row * 11}" fill="#999">{label}: n/a</text>')
            continue
        px = x(val)
        parts.append(
            f'<circle cx="{px:.1f}" cy="70" r="5" fill="{color}"><title>{label} {val:.3g}</title></circle>'
            f'<text x="{min(max(px, PAD + 30), W - 40):.1f}" y="{50 - row * 11}" text-anchor="middle" '
            f'fill="{color}">{label} '
            f"{val:.2g}</text>"
        )
    return _svg("".join(parts), title="k2: noise · threshold · measured")


def history_svg(points: Sequence[tuple[str, float | None, float | None]]) -> str:
    """k2 per night (date, k2, threshold k2), log y; the threshold dashed."""
    ks, ts = [k for _, k, _ in points], [t for _, _, t in points]
    y = _Log(ks + ts, H - 22, 16)
    n = len(points)

    def x(i: float) -> float:
        return PAD + 8 + i / max(n - 1, 1) * (W - PAD - 24)

    parts = [_y_log_axis(y, W)]
    for vals, color, dash in ((ts, "#b71c1c", ' stroke-dasharray="4 3"'), (ks, LINE, "")):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(vals) if v is not None)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}"{dash}/>')
    for i, (date, k, _) in enumerate(points):
        if k is not None:
            parts.append(
                f'<circle cx="{x(i):.1f}" cy="{y(k):.1f}" r="3" fill="{LINE}"><title>{esc(date)}: k2 '
                f"{k:.3g}</title></circle>"
            )
    parts.append(
        f'<text x="{PAD}" y="{H - 4}">{esc(points[0][0][:10])}</text><text x="{W - 6}" y="{H - 4}" '
        f'text-anchor="end">{esc(points[-1][0][:10])}</text>'
    )
    return _svg("".join(parts), title="k2 per night (threshold dashed)")
