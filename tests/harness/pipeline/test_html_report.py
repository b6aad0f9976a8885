"""The HTML report: built from real judge() verdicts with position detail, checked as HTML and, when Debian's
chromium is installed (CI: ``apt-get install -y chromium``), rendered headless: a screenshot that is not blank
and the DOM after rendering (rows, the expected-FAIL marking, the SVG plots)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from lpdiff.harness.pipeline.html_report import write_report
from lpdiff.harness.pipeline.metrics import compare, position_detail
from lpdiff.harness.pipeline.thresholds import Threshold
from lpdiff.harness.pipeline.verdict import from_json, judge, to_json
from lpdiff.harness.types import LogprobRun, PromptLogprobs

EPS = 1e-3


def _runs(noise: float, seed: int) -> tuple[LogprobRun, LogprobRun]:
    rng = np.random.default_rng(seed)
    a, b = [], []
    for n in (40, 60, 30):
        ids = rng.integers(0, 100, n)
        lp = -rng.random(n - 1).astype(np.float32) * 5
        margin = rng.random(n).astype(np.float32)
        margin[n // 2] = EPS / 10  # a router near-tie half-way along each prompt
        b.append(PromptLogprobs(ids, lp, router_margin=margin))
        a.append(PromptLogprobs(ids, lp + rng.normal(0, noise, n - 1).astype(np.float32), router_margin=margin))
    return LogprobRun(a), LogprobRun(b)


def _thr(**kw) -> Threshold:
    return Threshold(
        k2=1e-6,
        max_abs=1e-2,
        delta_fidelity=None,
        source="measured",
        noise_k2=1e-7,
        noise_max_abs=1e-3,
        margin_factor=10.0,
        model="tiny-qwen3-moe",
        engine_pair="triton-vs-hf",
        dtype="float32",
        tp=1,
        **kw,
    )


def _verdicts(scale: float = 1.0):
    out = []
    for adapter, noise, expected in (
        ("attention", 1e-5, "PASS"),
        ("zoo:lora_b_unmasked", 0.3 * scale, "FAIL"),
        ("experts", 0.1 * scale, "PASS"),
    ):
        a, b = _runs(noise, seed=len(out))
        v = judge(compare(a, b, EPS), _thr(), adapter=adapter)
        v.expected = expected
        v.detail = position_detail(a, b, EPS)
        out.append(v)
    return out


METAMORPHIC = [
    {
        "engine": "triton",
        "model": "tiny-qwen3-moe",
        "dtype": "float32",
        "adapter": "all",
        "results": [
            {"relation": "rank_pad", "verdict": "PASS", "note": ""},
            {"relation": "merged", "verdict": "FAIL", "note": "x"},
            {"relation": "tp2", "verdict": "n/a", "note": "needs 2 GPUs"},
        ],
    }
]


@pytest.fixture()
def report(tmp_path) -> Path:
    night1 = json.loads(to_json(_verdicts(scale=0.5)))
    night1["created"] = "2026-01-01T03:00:00+00:00"
    (tmp_path / "night1.json").write_text(json.dumps(night1))
    (tmp_path / "night2.json").write_text(to_json(_verdicts(), metamorphic=METAMORPHIC))
    return write_report([tmp_path / "night2.json", tmp_path / "night1.json"], tmp_path / "report.html")


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _check_dom(text: str) -> None:
    p = _Collect()
    p.feed(text)
    rows = [a for t, a in p.tags if t == "tr" and "row" in (a.get("class") or "").split()]
    assert [r["data-outcome"] for r in rows] == ["pass", "xfail", "fail"]
    assert "expected FAIL" in text and 'class="st xfail"' in text
    assert sum(t == "svg" for t, _ in p.tags) >= 3 * 4  # positions, histogram, scale and history per lane
    assert sum(t == "line" and "tie" in (a.get("class") or "") for t, a in p.tags) >= 3  # near-ties marked
    assert any(t == "table" and a.get("id") == "metamorphic" for t, a in p.tags)
    assert not [
        a
        for t, a in p.tags
        if any(str(v).startswith(("http:", "https:", "//")) for k, v in a.items() if k in ("src", "href"))
    ], "the page must not load anything"


def test_json_envelope_and_old_list_form():
    vs = _verdicts()
    doc = json.loads(to_json(vs))
    assert doc["schema_version"] == 1 and len(doc["verdicts"]) == 3
    assert doc["verdicts"][1]["expected"] == "FAIL"
    d = doc["verdicts"][0]["detail"]
    assert sum(len(p["d"]) for p in d["prompts"]) == d["num_positions"] == 127 and sum(d["hist"]["counts"]) == 127
    back = from_json(json.dumps(doc))
    assert [v.expected for v in back] == ["PASS", "FAIL", "PASS"] and back[2].passed is False
    old = json.dumps(doc["verdicts"])  # the bare list older lpdiff wrote
    assert [v.adapter for v in from_json(old)] == [v.adapter for v in vs]
    doc["schema_version"] = 99
    with pytest.raises(ValueError, match="upgrade lpdiff"):
        from_json(json.dumps(doc))


def test_detail_is_capped():
    a, b = _runs(0.1, 0)
    d = position_detail(a, b, EPS, max_positions=50)
    assert [len(p["d"]) for p in d["prompts"]] == [39, 11] and d["num_positions"] == 127
    assert sum(d["hist"]["counts"]) == 127


def test_report_html(report):
    _check_dom(report.read_text())


def test_report_rejects_non_verdict_json(tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match=r"x.json"):
        write_report([tmp_path / "x.json"], tmp_path / "r.html")


def _png_pixels(data: bytes) -> np.ndarray:
    """8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes) -> (h, w, c) array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6) and chunk[12] == 0, "unexpected PNG kind"
            c = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * c)
    out = np.zeros((h, w * c), np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        prev = out[y - 1] if y else np.zeros(w * c, np.int32)
        if f in (0, 2):
            out[y] = (line + (prev if f == 2 else 0)) & 255
            continue
        row = np.zeros(w * c, np.int32)
        for i in range(w * c):
            left = row[i - c] if i >= c else 0
            up, ul = prev[i], (prev[i - c] if i >= c else 0)
            if f == 1:
                pred = left
            elif f == 3:
                pred = (left + up) // 2
            else:
                p = left + up - ul
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - ul)
                pred = left if pa <= pb and pa <= pc else (up if pb <= pc else ul)
            row[i] = (line[i] + pred) & 255
        out[y] = row
    return out.reshape(h, w, c)


def chromium_command() -> list[str] | None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    return (
        None
        if exe is None
        else [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-extensions",
        ]
    )


@pytest.mark.skipif(chromium_command() is None, reason="chromium is not installed (CI: apt-get install -y chromium)")
def test_report_in_headless_chromium(report, tmp_path):
    cmd = chromium_command()
    shot = tmp_path / "shot.png"
    url = report.resolve().as_uri()
    subprocess.run(
        [*cmd, f"--screenshot={shot}", "--window-size=1200,900", url], check=True, timeout=120, capture_output=True
    )
    px = _png_pixels(shot.read_bytes())[..., :3]
    assert px.shape[:2] == (900, 1200)
    assert px.std() > 20 and len(np.unique(px.reshape(-1, 3), axis=0)) > 50, "the screenshot is blank"
    dom = subprocess.run([*cmd, "--dump-dom", url], check=True, timeout=120, capture_output=True, text=True).stdout
    _check_dom(dom)


def _rows(text: str) -> list[dict]:
    p = _Collect()
    p.feed(text)
    return [a for t, a in p.tags if t == "tr" and "row" in (a.get("class") or "").split()]


@pytest.mark.parametrize(
    "content, says",
    [
        ("[1, 2]", "verdict 0 is a number, not a verdict object"),  # a JSON list: exit 3 with a traceback before
        ("[]", "no verdicts in any file"),
        ('{"a": 1}', "not an lpdiff verdict document"),
        ("{not json", "not JSON (line 1"),
        ("PARTIAL", "lacks passed"),  # a verdict without 'passed': `error: passed` before
        ("NOMETRIC", "metrics has no k2"),
    ],
)
def test_bad_report_input_exits_2_naming_the_file(content, says, tmp_path, capsys):
    from lpdiff.harness.cli import main

    if content in ("PARTIAL", "NOMETRIC"):
        doc = json.loads(to_json(_verdicts()))
        owner, key = (doc["verdicts"][1], "passed") if content == "PARTIAL" else (doc["verdicts"][1]["metrics"], "k2")
        del owner[key]
        content = json.dumps(doc)
    bad = tmp_path / "night.json"
    bad.write_text(content)
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and says in err and "Traceback" not in err, err
    assert not (tmp_path / "r.html").exists()


def test_report_draws_the_json_of_run_case(tmp_path, capsys):
    """`lpdiff run --case --json`'s object is one lane: engine vs trainer, kl_v2 against the case's threshold."""
    from lpdiff.harness.cli import main
    from lpdiff.harness.commands.case import CaseVerdict, case_json

    a, b = _runs(1e-3, 0)
    m = compare(a, b)
    v = CaseVerdict(
        "hf://datasets/acme/case",
        "tiny-qwen3-moe",
        "triton",
        "float32",
        1,
        5e-3,
        m.k2,
        2e-6,
        3e-6,
        0.01,
        0.2,
        True,
        m,
        True,
        "",
    )
    (tmp_path / "case.json").write_text(case_json(v))
    assert main(["report", str(tmp_path / "case.json"), "-o", str(tmp_path / "r.html")]) == 0, capsys.readouterr()
    text = (tmp_path / "r.html").read_text()
    assert [r["data-outcome"] for r in _rows(text)] == ["pass"]
    assert "triton:float32-vs-trainer" in text and "case hf://datasets/acme/case" in text
    assert "the case&#x27;s kl_v2 threshold" in text


def test_report_says_unmeasured_fidelity_next_step_and_absent_lanes(tmp_path):
    """Night 2 lost night 1's experts lane (and its zoo lane now runs as triton at TP 2, another lane), judges one lane
    against an unmeasured default threshold and FAILs the triton lane: the page shows the vanished lane as "absent in
    newest night", says which threshold is a guess (a banner and the threshold column), has a delta-fidelity column, and
    names the bisect command."""
    night1 = json.loads(to_json(_verdicts()))
    night1["created"] = "2026-01-01T03:00:00+00:00"
    vs = _verdicts()[:2]
    vs[0].threshold = Threshold(k2=1e-6, max_abs=1e-2, delta_fidelity=0.05, source="unmeasured", match="default")
    vs[0].delta_fidelity = {"attention": 0.0123, "experts": 0.5}
    vs[1].engine_pair, vs[1].tp, vs[1].expected = "triton:float32-vs-hf:float32", 2, "PASS"
    (tmp_path / "n1.json").write_text(json.dumps(night1))
    (tmp_path / "n2.json").write_text(to_json(vs))
    text = write_report([tmp_path / "n1.json", tmp_path / "n2.json"], tmp_path / "r.html").read_text()
    rows = _rows(text)
    assert [r["data-outcome"] for r in rows] == ["pass", "fail", "absent", "absent"]
    assert "absent in newest night" in text and "2 lane(s) judged in an earlier night are absent" in text
    assert "1 of 2 lanes are judged against an unmeasured default threshold" in text
    assert "unmeasured default (the dtype&#x27;s default)" in text and "<th>Δ fidelity</th>" in text
    assert "0.5 [experts]" in text
    assert "<code>lpdiff bisect tiny-qwen3-moe --adapter zoo:lora_b_unmasked --tp 2</code>" in text
