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
    """benchmarks/detection.py --routing-replay: noise = each run against the reference replaying its own ids. The
    engine options main passes (the grid's step) reach the check, and the row names the step it was measured at."""
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
        options={"max_batch_tokens": 64},
    )
    assert row["engine_pair"] == "triton:bfloat16-vs-hf[replay]:float32", row
    assert row["noise_source"] == detection.P999 + "; triton at 64-token prefill steps", row
    noise, thr, effect = float(row["noise_k2"]), float(row["threshold_k2"]), float(row["min_zoo_effect_k2"])
    assert 0 < noise <= thr < effect, row


@pytest.mark.parametrize(
    ("argv", "grid_max", "want"),
    [
        ([], 4096, {"llm_kwargs": {"max_num_batched_tokens": 4096}}),  # the grid's default step, below vLLM's 16384
        (["--engine-step"], 4096, None),  # vLLM's own step
        ([], 16384, {}),  # a grid run at vLLM's own step sets none
    ],
)
def test_engine_rows_run_at_the_gpu_grids_prefill_step(tmp_path, monkeypatch, argv, grid_max, want):
    """--engine rows take the GPU grid's step options (suites/test_engines_gpu.py step_options), so detection rows and
    the grid's verdicts are measured at one step. measure_engine is replaced by a recorder here: the real row needs a
    GPU for vLLM (the real rows run on CPU in the tests above); the options it records are the ones main passes."""
    import suites.test_engines_gpu as grid

    for var in ("LPDIFF_VLLM_OPTIONS", "LPDIFF_VLLM_PYTHONPATH", "LPDIFF_VLLM_PYTHON"):  # where vLLM is: not asked
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(grid, "GRID_MAX_STEP", grid_max)  # what LPDIFF_GRID_MAX_STEP sets when the suite is imported
    got = []

    def record(model, engine, dtype, *args, **kw):
        got.append((model, engine, dtype, kw["options"], kw["routing_replay"]))
        return dict.fromkeys(detection.COLUMNS, "1")

    monkeypatch.setattr(detection, "measure_engine", record)
    out = tmp_path / "rows.csv"
    argv = ["--full-width", "qwen3-30b-a3b", "--engine", "vllm", "--dtype", "bfloat16", "--routing-replay", *argv]
    assert detection.main([*argv, "--out", str(out)]) == 0
    assert got == [("qwen3-30b-a3b", "vllm", "bfloat16", want, True)]
    assert len(out.read_text().splitlines()) == 2
