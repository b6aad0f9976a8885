"""benchmarks/detection.py's engine rows, on CPU: HF+PEFT in bf16 as the engine under test on the tiny zoo."""
import pytest

from benchmarks import detection


@pytest.mark.filterwarnings("ignore")
def test_engine_row_has_noise_threshold_and_the_broken_adapters_effect(tmp_path, monkeypatch):
    monkeypatch.setenv("LPDIFF_BASELINES", str(tmp_path / "store"))
    row = detection.measure_engine("tiny-qwen3-moe", "hf", "bfloat16", layers=2, reruns=2, device="cpu",
                                   lengths=(48, 33))
    assert set(row) == set(detection.COLUMNS) - {"misses"}  # main() adds it to every row
    assert "threshold/noise" in detection.misses(float(row["effect_over_threshold"]), 3.0)
    noise, thr, effect = float(row["noise_k2"]), float(row["threshold_k2"]), float(row["min_zoo_effect_k2"])
    assert 0 < noise <= thr < effect, row  # a correct bf16 engine sits under the threshold, the broken adapter above
    assert row["reruns"] == 2 and row["engine_pair"].startswith("hf:bfloat16")
