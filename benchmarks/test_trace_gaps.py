"""benchmarks/trace_gaps.py on hand-made chrome traces (a GPU trace needs a GPU; the format is torch's)."""

import gzip
import json

import pytest

from benchmarks.trace_gaps import analyse, load_events, report


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


TRACE = [
    _x("Batch.build", "cpu_op", 0, 120),  # host work before anything reaches the GPU
    _x("gemm", "kernel", 100, 50),
    _x("norm", "kernel", 140, 30),  # overlaps the gemm (another stream): one busy stretch
    _x("aten::nonzero", "cpu_op", 160, 400),  # a sync: the GPU idles until the host launches again
    _x("cudaStreamSynchronize", "cuda_runtime", 170, 300),
    _x("logprobs", "kernel", 500, 40),
    _x("Memcpy DtoH", "gpu_memcpy", 560, 5),
    _x("to_numpy", "cpu_op", 565, 35),
    {"ph": "i", "name": "marker", "ts": 10},  # not a span: ignored
]


def test_gaps_found_with_their_host_work(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    res = analyse(load_events(path), min_gap_us=10)
    assert res["span_us"] == 600
    assert res["busy_us"] == 115  # 100-170, 500-540, 560-565
    assert res["idle_us"] == 600 - 115
    durs = [g["dur_us"] for g in res["gaps"]]
    assert durs == sorted(durs, reverse=True) and durs[0] == 330  # 170 -> 500
    assert res["gaps"][0]["host"][:2] == ["aten::nonzero", "cudaStreamSynchronize [cuda_runtime]"]
    assert any(g["where"] == "before the first kernel" and g["dur_us"] == 100 for g in res["gaps"])
    assert "idle 0.48 ms" in report(res)


def test_cpu_only_trace_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([_x("aten::mm", "cpu_op", 0, 5)]))
    with pytest.raises(ValueError, match="no GPU kernels"):
        analyse(load_events(path))
