"""benchmarks/bench_ssd.py on CPU: its --check mode (both scans interpreted in fp32 against the torch reference, the
rows it would time), the layouts it parses, and its floor growing with the work it counts."""

from __future__ import annotations

import pytest

from benchmarks import bench_ssd


def test_check_mode_runs_both_scans_against_the_reference():
    rows = bench_ssd.main(["--check"])
    assert [r["impl"] for r in rows] == ["recurrence", "chunked"]
    assert all(float(r["rel_err"]) <= 1e-5 for r in rows), rows


def test_layouts_and_floor():
    assert bench_ssd.parse_layout("8x512") == [512] * 8
    assert sum(bench_ssd.parse_layout("ragged")) == 4096
    with pytest.raises(ValueError):
        bench_ssd.parse_layout("512")
    m = bench_ssd.MODELS["nano"]
    one = bench_ssd.floor_ms([512], m, 1e15, 4e12)
    assert bench_ssd.floor_ms([512] * 8, m, 1e15, 4e12) == pytest.approx(8 * one)
    # a prompt of 129 tokens pays a second chunk of states and of chunk products: more than 129/128 of one of 128
    assert bench_ssd.floor_ms([129], m, 1e15, 1e30) > 129 / 128 * bench_ssd.floor_ms([128], m, 1e15, 1e30)
