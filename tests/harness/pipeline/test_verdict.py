"""Thresholds (lookup fallbacks, provenance, record) and verdicts on hand-made metrics."""

import dataclasses
import json
import math
import shutil

import pytest

from lpdiff.harness.pipeline.metrics import Metrics
from lpdiff.harness.pipeline.report import verdict_table
from lpdiff.harness.pipeline.thresholds import DEFAULT_PATH, Threshold, from_noise, lookup, pair_name, record
from lpdiff.harness.pipeline.verdict import judge, next_step, to_json


def metrics(k2=1e-9, max_abs=1e-4, **kw) -> Metrics:
    fields = dict(
        num_positions=100,
        k1=0.0,
        k2=k2,
        k3=k2,
        max_abs=max_abs,
        mean_abs=max_abs / 10,
        p99_abs=max_abs / 2,
        over_0_1=0.0,
        over_0_5=0.0,
        over_1_0=0.0,
        num_nonfinite=0,
    )
    fields.update(kw)
    return Metrics(**fields)


def thr(k2=1e-6, max_abs=1e-3, delta_fidelity=0.05, source="unmeasured", **kw) -> Threshold:
    return Threshold(
        k2=k2,
        max_abs=max_abs,
        delta_fidelity=delta_fidelity,
        source=source,
        model="tiny-moe",
        engine_pair="triton-vs-hf",
        dtype="float32",
        tp=1,
        **kw,
    )


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "thresholds.json"
    shutil.copy(DEFAULT_PATH, path)
    return path


def test_shipped_defaults_are_unmeasured_and_cover_every_dtype():
    for dtype in ("float32", "bfloat16", "float16"):
        t = lookup("some-model", ("vllm", "hf"), dtype, 8)
        assert (t.source, t.match, t.engine_pair, t.tp) == ("unmeasured", "default", "vllm-vs-hf", 8)
        assert "default" in t.note
    assert lookup("m", "a-vs-b", "float32", 1).k2 < lookup("m", "a-vs-b", "bfloat16", 1).k2
    with pytest.raises(KeyError, match="float8"):
        lookup("m", "a-vs-b", "float8", 1)
    with pytest.raises(AssertionError, match="vllm-vs-hf"):
        pair_name("vllm/hf")


def test_record_then_lookup_with_fallbacks(table):
    t = from_noise(2e-10, 3e-5, 10.0, noise_delta_fidelity=1e-3, gpu="H200", commit="abc1234", note="8 prompts")
    assert (t.k2, t.max_abs, t.delta_fidelity, t.source) == (
        pytest.approx(2e-9),
        pytest.approx(3e-4),
        pytest.approx(1e-2),
        "measured",
    )
    record("tiny-moe", ("triton", "hf"), "float32", 1, t, path=table)
    record("tiny-moe", ("triton", "hf"), "float32", 4, from_noise(1e-9, 1e-4, 10.0, gpu="H200", commit="c"), path=table)
    exact = lookup("tiny-moe", "triton-vs-hf", "float32", 1, path=table)
    assert (exact.match, exact.source, exact.gpu, exact.k2) == ("exact", "measured", "H200", pytest.approx(2e-9))
    other = lookup("tiny-moe", "triton-vs-hf", "float32", 2, path=table)  # tp=1 is nearer than tp=4
    assert (other.match, other.tp, other.k2) == ("other-tp", 2, pytest.approx(2e-9))
    assert "no entry for tp=2; using the tp=1 entry" in other.note and other.provenance == "measured (other-tp)"
    assert lookup("tiny-moe", "triton-vs-hf", "bfloat16", 1, path=table).match == "default"
    # recording again replaces the entry instead of adding a second one
    record("tiny-moe", ("triton", "hf"), "float32", 1, from_noise(1e-10, 1e-5, 5.0, gpu="H100", commit="d"), path=table)
    entries = [e for e in json.loads(table.read_text())["entries"] if e["model"] == "tiny-moe"]
    assert len(entries) == 2 and lookup("tiny-moe", "triton-vs-hf", "float32", 1, path=table).gpu == "H100"


def test_measured_threshold_needs_its_noise_floor():
    with pytest.raises(AssertionError, match="noise floor"):
        Threshold(k2=1e-6, max_abs=1e-3, delta_fidelity=None, source="measured")


def test_pass():
    v = judge(
        metrics(), thr(source="measured", noise_k2=1e-8, noise_max_abs=1e-4, margin_factor=10), 0.01, adapter="r8"
    )
    assert v.passed and v.reasons == [] and v.notes == []
    assert (v.model, v.engine_pair, v.dtype, v.tp, v.adapter) == ("tiny-moe", "triton-vs-hf", "float32", 1, "r8")


@pytest.mark.parametrize(
    "m, fidelity, want",
    [
        (metrics(k2=3e-6), None, ["k2 3e-06 > threshold 1e-06"]),  # k2 alone over
        (metrics(max_abs=0.25), None, ["max |Δ| 0.25 > threshold 0.001"]),  # one bad position, tiny k2
        (metrics(), 0.97, ["delta fidelity 0.97 > threshold 0.05"]),  # adapter dropped while k2 stays small
        (metrics(), {"attention": 0.01, "experts": 1.0}, ["delta fidelity [experts] 1 > threshold 0.05"]),
        (
            metrics(k2=float("nan"), num_nonfinite=2),
            None,  # NaN must fail, not slip past a ">" comparison
            ["2 of 100 positions have a NaN or inf logprob", "k2 nan > threshold 1e-06"],
        ),
        (
            metrics(k2=2e-6, max_abs=0.5),
            0.5,
            ["k2 2e-06 > threshold 1e-06", "max |Δ| 0.5 > threshold 0.001", "delta fidelity 0.5 > threshold 0.05"],
        ),  # every reason listed
    ],
)
def test_fail_reasons_name_metric_and_both_numbers(m, fidelity, want):
    v = judge(m, thr(), fidelity)
    assert not v.passed and v.reasons == want
    assert v.notes[0].startswith("threshold is unmeasured")


def test_near_ties_reported_not_hidden():
    clean = metrics(num_positions=80)
    m = metrics(k2=5e-6, near_tie_share=0.2, clean=clean)
    v = judge(m, thr())
    assert not v.passed and v.near_tie_share == 0.2
    assert "the 80 positions without a router near-tie are within the threshold" in v.reasons[-1]
    assert "20.0% near-tie" in v.reasons[-1]
    ex = judge(m, thr(), exclude_near_ties=True)
    assert ex.passed and any("20.0% at or after a router near-tie were excluded" in n for n in ex.notes)
    with pytest.raises(ValueError, match="router margins"):
        judge(metrics(), thr(), exclude_near_ties=True)


def test_table_and_json():
    vs = [
        judge(metrics(), thr(), 0.01, adapter="r8"),
        judge(metrics(k2=float("nan"), num_nonfinite=1), thr(), {"attention": 0.0, "experts": 1.0}),
    ]
    text = verdict_table(vs, wide=True)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].split()[:2] == ["model", "engine"] and set(lines[1]) <= {"-", " "}
    assert "PASS" in lines[2] and "r8" in lines[2] and "0.01" in lines[2]
    assert "FAIL (unexpected)" in lines[3] and "1 [experts]" in lines[3] and "NaN or inf" in lines[3]
    assert lines[2].rindex("PASS") == lines[3].index("FAIL")  # columns line up: expected PASS, got FAIL
    doc = json.loads(to_json(vs))
    assert doc["schema_version"] == 1 and doc["lpdiff_version"] and doc["created"]
    data = doc["verdicts"]
    assert data[0]["passed"] is True and data[0]["metrics"]["k2"] == 1e-9
    assert data[1]["metrics"]["k2"] == "nan" and data[1]["delta_fidelity"]["experts"] == 1.0
    assert data[1]["threshold"]["source"] == "unmeasured" and not math.isnan(data[0]["threshold"]["k2"])


def _lanes(n_adapters: int = 6, tps=(1, 2)) -> list:
    """A default run's verdicts: base + five zoo adapters at TP 1 and 2, the TP 2 lanes failing with the long
    reasons real verdicts carry, the model's longest zoo name."""
    out = []
    names = ["-", "all", "attention", "experts", "experts_per_expert", "experts_shared_outer"][:n_adapters]
    for tp in tps:
        for a in names:
            bad = tp == 2
            v = judge(
                metrics(k2=0.0153 if bad else 1e-9, max_abs=0.3 if bad else 1e-7),
                thr(),
                None if a == "-" else {"attention": 0.0012, "experts": 0.61 if bad else 1e-4},
                adapter=a,
            )
            v.model, v.engine_pair, v.dtype, v.tp = "tiny-qwen3.5-moe", "triton:float32-vs-hf:float32", "float32", tp
            if bad:
                v.next_step = next_step(v.engine_pair, v.model, a, tp, ())
            out.append(v)
    return out


def test_default_table_fits_120_columns_and_names_the_next_step():
    """A default run's 12 lanes were 187-282 columns wide; the default table fits 120, says what every row shares
    once above it, and each unexpected lane's reasons and the bisect command below it; --wide (wide=True) keeps
    every column in the rows."""
    vs = _lanes()
    text = verdict_table(vs)
    assert max(map(len, text.splitlines())) <= 120, text
    lines = text.splitlines()
    assert lines[0] == "engine pair triton:float32-vs-hf:float32, expected PASS"
    assert lines[1].split() == ["model", "TP", "adapter", "k2", "max", "|Δ|", "Δ", "fid", "tie", "thr", "verdict"]
    row = next(line for line in lines if " experts_shared_outer " in line and "FAIL" in line)
    assert row.split()[:2] == ["tiny-qwen3.5-moe", "2"] and "0.61 [experts]" in row and "unmeas" in row
    assert any(line.startswith("thr: unmeas = an unmeasured default threshold") for line in lines)
    assert sum(line.startswith("FAIL (unexpected) tiny-qwen3.5-moe tp=2") for line in lines) == 6
    assert lines[-1] == "next step: lpdiff bisect tiny-qwen3.5-moe --tp 2"  # once, not once per lane
    wide = verdict_table(vs, wide=True)
    assert "triton:float32-vs-hf:float32" in wide.splitlines()[2] and "lpdiff bisect" in wide.splitlines()[-1]
    mixed = [*vs[:1], dataclasses.replace(vs[1], engine_pair="vllm:bfloat16-vs-hf:float32", dtype="bfloat16")]
    assert "engine" in verdict_table(mixed).splitlines()[1].split()  # rows that differ keep the column
    md = verdict_table(vs, "github")
    assert "max \\|Δ\\|" in md and md.splitlines()[-1].endswith("--tp 2  ")


def test_next_step_per_engine():
    assert next_step(
        "triton:float32-vs-hf:float32",
        "tiny-qwen3-moe",
        "experts",
        2,
        ("experts", "/my dir/a"),
        {"fault": "topk_weight_missing"},
    ) == ("lpdiff bisect tiny-qwen3-moe --adapter experts --adapter '/my dir/a' --tp 2 --fault topk_weight_missing")
    assert (
        next_step("triton:float32-vs-hf:float32", "tiny-qwen3-moe", "experts", 1)
        == "lpdiff bisect tiny-qwen3-moe --adapter experts --tp 1"
    )
    assert next_step("vllm:bfloat16-vs-hf:float32", "Qwen/Qwen3-30B-A3B", "my-lora", 4) == (
        "lpdiff doctor Qwen/Qwen3-30B-A3B my-lora --engine vllm; "
        "lpdiff metamorphic Qwen/Qwen3-30B-A3B my-lora --engine vllm --tp 4"
    )
    assert next_step("sglang:bfloat16-vs-hf:float32", "m", "-", 2).startswith(
        "lpdiff compare --model m --engine sglang"
    )
    assert "constraints.txt" in next_step("hf:float32-vs-hf:float32", "tiny-qwen3-moe", "all", 1)
    # an arch bisect cannot capture: the runtime against itself; a base lane names an adapter of its batch
    assert (
        next_step("triton:float32-vs-hf:float32", "tiny-qwen3.5-moe", "-", 2, (), bisect=False)
        == "lpdiff metamorphic tiny-qwen3.5-moe all --engine triton --tp 2"
    )
