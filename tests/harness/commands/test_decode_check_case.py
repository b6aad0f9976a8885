"""The decode verdict's broken lane (harness/commands/decode.py ``check_case_decode``: ``lpdiff check --decode N`` and
the GPU grid's decode lane) on the tiny zoo, CPU: the engine serves the check case's ``broken`` adapter (every
expert's LoRA-B shifted one expert) while the fp32 reference scores the engine's sequences with the correct ``all``
file it was made from; the broken lane FAILs, the correct lanes and base rows PASS, and the result is as expected.
The hf engine decodes with its KV cache (bf16 and fp32), the triton runtime greedily by re-prefill. Thresholds are the
recorded ones of each engine pair (harness/pipeline/thresholds.json), as ``lpdiff run --decode`` judges."""

from __future__ import annotations

import csv
import dataclasses
import re

import numpy as np
import pytest

from lpdiff.harness.commands import check
from lpdiff.harness.commands.decode import (
    DECODE_CSV_COLUMNS,
    DecodeResult,
    check_case_decode,
    format_decode,
    judge_lane,
    write_decode_csv,
)
from lpdiff.harness.pipeline.rl_metrics import decode_metrics
from lpdiff.harness.pipeline.thresholds import lookup
from lpdiff.harness.spec.errors import InputError

MODEL = "tiny-qwen3-moe"
CORRECT = {"base", "all", "attention", "experts", "all_r8"}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return check.build_case(
        MODEL, 2, tmp_path_factory.mktemp("case"), device="cpu", lengths=(48, 33), log=lambda s: None
    )


def _threshold(engine: str, dtype: str):
    return lookup(MODEL, f"{engine}:{dtype}-vs-hf:float32", dtype, 1)


def _decode(case, engine: str, dtype: str, n: int) -> DecodeResult:
    return check_case_decode(case, engine, _threshold(engine, dtype), dtype=dtype, max_new_tokens=n, log=lambda s: None)


@pytest.mark.parametrize(
    "engine, dtype, n",
    [
        ("hf", "bfloat16", 4),  # the GPU grid's setting: a bf16 engine against the fp32 reference
        ("hf", "float32", 4),
        ("triton", "float32", 3),  # greedy by re-prefill: one prefill per generated token
    ],
)
def test_the_broken_lane_fails_and_the_correct_lanes_pass(case, engine, dtype, n, tmp_path):
    res = _decode(case, engine, dtype, n)
    got = {ln.lane: ln for ln in res.lanes}
    assert set(got) == CORRECT | {"broken"}
    assert {name: ln.expected for name, ln in got.items()} == {**dict.fromkeys(CORRECT, "PASS"), "broken": "FAIL"}
    assert all(got[name].passed for name in CORRECT), format_decode(res)
    broken = got["broken"]
    assert not broken.passed and broken.reasons[0].startswith("k2 "), format_decode(res)
    assert res.as_expected and not res.passed
    out = format_decode(res)
    assert f"{MODEL}: as expected\n" in out and "(unexpected)" not in out
    assert not re.search(r"^lane \w+: expected", out, re.MULTILINE), out
    # the broken lane's row: expected FAIL, verdict FAIL with its reasons
    assert re.search(r"^broken .* FAIL +FAIL: k2 ", out, re.MULTILINE), out
    with open(tmp_path / "d.csv", "w", newline=""):
        pass  # an empty file gets the header
    write_decode_csv(res, tmp_path / "d.csv")
    with open(tmp_path / "d.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == DECODE_CSV_COLUMNS and DECODE_CSV_COLUMNS[-1] == "expected"
    assert {(r["lane"], r["expected"], r["verdict"]) for r in rows} == {
        *((name, "PASS", "PASS") for name in CORRECT),
        ("broken", "FAIL", "FAIL"),
    }


def test_the_broken_lane_judged_against_its_own_file_passes(case):
    """What the broken lane's FAIL above rests on: the reference scoring its sequences with ``broken_from``'s file.
    The same case with the broken plan's ``broken_from`` cleared (the reference reads the broken file the engine
    serves) passes that lane; so a check_case_decode that judged the lane against its own file would fail the test
    above (broken expected FAIL, got PASS)."""
    plans = {**case.plans, "broken": dataclasses.replace(case.plans["broken"], broken_from=None)}
    res = _decode(dataclasses.replace(case, plans=plans), "triton", "float32", 3)
    broken = next(ln for ln in res.lanes if ln.lane == "broken")
    assert broken.passed and broken.expected == "PASS" and res.passed and res.as_expected, format_decode(res)


def _lane(name: str, engine, expected: str = "PASS"):
    ref = [np.array([-1.0, -0.5, -2.0]), np.array([-0.25, -3.0, -1.0])]
    m = decode_metrics(engine, ref)
    return judge_lane(name, m, _threshold("hf", "float32"), expected)


def _result(lanes) -> DecodeResult:
    return DecodeResult(
        MODEL, "hf", "hf", "float32", "float32", 1, 3, "greedy", 0, "decode", "v", _threshold("hf", "float32"), lanes
    )


def test_a_lane_not_as_expected_is_named_with_why():
    """A broken lane that passes, a correct lane off the reference, and one with a NaN logprob: the verdict line
    says NOT AS EXPECTED and one line per such lane names it (the NaN: its prompt and generated position)."""
    same = [np.array([-1.0, -0.5, -2.0]), np.array([-0.25, -3.0, -1.0])]
    off = [np.array([-1.0, -0.5, -2.0]), np.array([-0.25, -2.5, -1.0])]
    nan = [np.array([-1.0, -0.5, -2.0]), np.array([-0.25, -3.0, np.nan])]
    res = _result([_lane("base", same), _lane("all", off), _lane("experts", nan), _lane("broken", same, "FAIL")])
    assert not res.as_expected and not res.passed
    out = format_decode(res)
    assert f"{MODEL}: NOT AS EXPECTED\n" in out
    bad = out.splitlines()[-3:]
    assert bad[0].startswith("lane all: expected PASS, got FAIL: k2 0.0208 > "), bad
    assert bad[1].startswith(
        "lane experts: expected PASS, got FAIL: 1 of 6 positions have a NaN or inf logprob: lane experts, first in "
        "prompt 1 at generated position 2 (engine)"
    )
    assert bad[2] == "lane broken: expected FAIL, got PASS: the verdict did not see a broken adapter"
    # every lane as expected: a broken lane that FAILs is
    ok = _result([_lane("base", same), _lane("broken", off, "FAIL")])
    assert ok.as_expected and "as expected\n" in format_decode(ok)
    # without a lane that must FAIL (lpdiff run --decode) the verdict line reads PASS / FAIL
    assert ": PASS\n" in format_decode(_result([_lane("base", same)]))
    assert ": FAIL\n" in format_decode(_result([_lane("all", off)]))


def test_a_decode_csv_with_another_header_is_refused_before_writing(tmp_path):
    """Rows with the appended ``expected`` column under an older header would be misread: one error naming the fix,
    the file untouched; the fix it names (run here) makes the file appendable."""
    import subprocess

    old = tmp_path / "engines_gpu_decode.csv"
    res = _result([_lane("base", [np.array([-1.0, -0.5, -2.0]), np.array([-0.25, -3.0, -1.0])])])
    with open(old, "w", newline="") as f:  # as csv writes it: CRLF line ends
        csv.writer(f).writerows([DECODE_CSV_COLUMNS[:-1], ["x"] * (len(DECODE_CSV_COLUMNS) - 1)])
    before = old.read_bytes()
    with pytest.raises(InputError, match=r"\(expected missing\); add the column\(s\) to its header: sed ") as err:
        write_decode_csv(res, old)
    assert old.read_bytes() == before
    subprocess.run(str(err.value).split("to its header: ")[1], shell=True, check=True)
    write_decode_csv(res, old)
    with open(old, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == DECODE_CSV_COLUMNS and [r["expected"] for r in rows] == [None, "PASS"]
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="write to a new file"):
        write_decode_csv(res, other)
