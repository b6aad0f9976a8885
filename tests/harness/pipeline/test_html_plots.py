"""harness/pipeline/html_plots.py: the report's hand-written SVG plots and the number reading they share."""

from __future__ import annotations

import math
import re
from xml.etree import ElementTree

from lpdiff.harness.pipeline.html_plots import PAD, H, W, esc, histogram_svg, num, positions_svg, scale_svg

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ElementTree.Element:
    root = ElementTree.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg" and (root.get("width"), root.get("height")) == (str(W), str(H))
    return root


def test_num_reads_json_numbers_and_the_special_floats_only():
    assert num(3) == 3.0 and num(-0.5) == -0.5 and math.isnan(num("nan")) and num("-inf") == -math.inf
    assert num(True) is None and num("1.5") is None and num(None) is None and num([1]) is None
    assert esc('<a href="x">&') == "&lt;a href=&quot;x&quot;&gt;&amp;"


def test_positions_mark_near_ties_and_separate_prompts():
    detail = {"prompts": [{"d": [1e-3, -2e-2, 0.0], "near_tie": [1]}, {"d": [5e-4, 1e-1]}], "num_positions": 9}
    root = parse(positions_svg(detail))
    lines = root.findall(f"{SVG}polyline")
    assert [len(p.get("points").split()) for p in lines] == [3, 2]  # one line per prompt, one point per position
    ties = [e for e in root.findall(f"{SVG}line") if e.get("class") == "tie"]
    assert len(ties) == 1  # the near tie at the first prompt's second position
    x = [float(pt.split(",")[0]) for p in lines for pt in p.get("points").split()]
    assert x == sorted(x) and x[0] == PAD and float(ties[0].get("x1")) == x[1]
    y = [float(pt.split(",")[1]) for pt in lines[1].get("points").split()]
    assert y[1] < y[0]  # |d| 0.1 sits above |d| 5e-4 on the log axis (SVG y grows downwards)
    assert "5 of 9 positions" in "".join(root.itertext())


def test_histogram_bars_scale_to_the_tallest_and_empty_detail_says_so():
    root = parse(histogram_svg({"hist": {"counts": [2, 8, 4], "edges": [-0.1, 0.0, 0.1, 0.2]}}))
    heights = [float(r.get("height")) for r in root.findall(f"{SVG}rect")]
    assert heights[1] == max(heights) and heights[1] == 2 * heights[2] == 4 * heights[0]
    assert "no histogram" in "".join(parse(histogram_svg({})).itertext())
    assert "no per-position detail" in "".join(parse(positions_svg({})).itertext())


def test_scale_orders_noise_threshold_and_k2_and_names_a_missing_one():
    v = {"threshold": {"noise_k2": 1e-6, "k2": 1e-4}, "metrics": {"k2": "nan"}}
    root = parse(scale_svg(v))
    dots = {c.find(f"{SVG}title").text.split()[0]: float(c.get("cx")) for c in root.findall(f"{SVG}circle")}
    assert set(dots) == {"noise", "threshold"} and dots["noise"] < dots["threshold"]
    assert re.search(r"k2: n/a", "".join(root.itertext()))
