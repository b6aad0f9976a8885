"""benchmarks/detection.py's engine rows, on CPU: HF+PEFT in bf16 as the engine under test on the tiny zoo."""

import pytest

from benchmarks import detection


@pytest.mark.filterwarnings("ignore")
def test_engine_row_has_noise_threshold_and_the_broken_adapters_effect(tmp_path, monkeypatch):
    monkeypatch.setenv("LPDIFF_BASELINES", str(tmp_path / "store"))
    row = detection.measure_engine(
        "tiny-qwen3-moe", "hf", "bfloat16", layers=2, reruns=2, device="cpu", lengths=(48, 33)
    )
    assert set(row) == set(detection.COLUMNS) - {"misses"}  # main() adds it to every row
    assert "threshold/noise" in detection.misses(float(row["effect_over_threshold"]), 3.0)
    noise, thr, effect = float(row["noise_k2"]), float(row["threshold_k2"]), float(row["min_zoo_effect_k2"])
    assert 0 < noise <= thr < effect, row  # a correct bf16 engine sits under the threshold, the broken adapter above
    assert row["reruns"] == 2 and row["engine_pair"].startswith("hf:bfloat16")


@pytest.mark.filterwarnings("ignore")
def test_hf_fp32_row_is_judged_against_the_triton_runtime_not_itself(tmp_path, monkeypatch):
    """HF fp32 against HF fp32 would be a self-comparison with zero noise; its row takes the triton runtime as the
    fp32 reference, and serves one layout when asked."""
    monkeypatch.setenv("LPDIFF_BASELINES", str(tmp_path / "store"))
    monkeypatch.setenv("LPDIFF_CHECK_CSV_DIR", str(tmp_path / "csv"))
    row = detection.measure_engine(
        "tiny-qwen3-moe",
        "hf",
        "float32",
        layers=2,
        reruns=2,
        device="cpu",
        lengths=(48, 33),
        layouts=("peft3d",),
        reference="triton",
    )
    assert row["engine_pair"] == "hf:float32-vs-triton:float32", row
    noise, thr, effect = float(row["noise_k2"]), float(row["threshold_k2"]), float(row["min_zoo_effect_k2"])
    assert noise > 0 and effect > 1e3 * max(thr, noise), row  # two implementations differ by rounding only
    lanes = (tmp_path / "csv" / "engines_gpu.csv").read_text()
    assert ",broken,peft3d," in lanes and "per_expert" not in lanes
    progress = (tmp_path / "csv" / "progress.log").read_text()  # each stage's line, timed, where the job collects files
    assert "[tiny-qwen3-moe-hf-float32] [check] hf tp=1: starting" in progress and "with start and close" in progress


def test_rows_of_one_model_share_one_case(monkeypatch):
    """--dtype float32 --dtype bfloat16 (or several engines in one process) build the model's adapters once."""
    from lpdiff.harness.commands import check

    built = []
    monkeypatch.setattr(
        check, "build_case", lambda model, layers, root, **kw: built.append((model, layers)) or object()
    )
    monkeypatch.setattr(detection, "_CASES", {})
    a = detection._case("m", 4, "peaked/v1", "cuda", (), print)
    assert detection._case("m", 4, "peaked/v1", "cuda", (), print) is a and built == [("m", 4)]
    detection._case("m", 8, "peaked/v1", "cuda", (), print)
    assert built == [("m", 4), ("m", 8)]


@pytest.mark.filterwarnings("ignore")
def test_engine_row_with_routing_replay(tmp_path, monkeypatch):
    """benchmarks/detection.py --routing-replay: noise = each run against the reference replaying its own ids."""
    monkeypatch.setenv("LPDIFF_BASELINES", str(tmp_path / "store"))
    row = detection.measure_engine(
        "tiny-qwen3-moe",
        "triton",
        "bfloat16",
        layers=2,
        reruns=2,
        device="cpu",
        lengths=(20, 12),
        layouts=("peft3d",),
        routing_replay=True,
    )
    assert row["engine_pair"] == "triton:bfloat16-vs-hf[replay]:float32", row
    noise, thr, effect = float(row["noise_k2"]), float(row["threshold_k2"]), float(row["min_zoo_effect_k2"])
    assert 0 < noise <= thr < effect, row
