"""suites/test_engines_gpu.py's decode lane (``test_decode_vs_reference``) run whole on CPU: the suite's own function,
its case swapped for the tiny zoo's check case (``case_for`` needs a GPU), so its assertions (a broken lane served,
the result as expected) and its CSV rows run here before a GPU lease does. HF in bf16 with seeded sampling, the
grid's setting for a bf16 engine, judged with the threshold the suite's own prefill check measures."""

import csv
import importlib.util

from tests.helpers.paths import REPO

_spec = importlib.util.spec_from_file_location("engines_gpu_grid_decode", REPO / "suites" / "test_engines_gpu.py")
grid_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid_module)


def test_the_suites_decode_lane_serves_the_broken_adapter_and_asserts_as_expected(
    tmp_path_factory, monkeypatch, capsys
):
    from lpdiff.harness.commands import check
    from lpdiff.harness.commands.decode import DECODE_CSV_COLUMNS

    case = check.build_case(
        "tiny-qwen3-moe", 2, tmp_path_factory.mktemp("case"), device="cpu", lengths=(40, 27), log=lambda s: None
    )
    out_dir = tmp_path_factory.mktemp("csv")
    monkeypatch.setattr(grid_module, "case_for", lambda model, factory: case)
    monkeypatch.setattr(grid_module, "DECODE_TOKENS", 3)
    monkeypatch.setattr(grid_module, "_DECODE_THRESHOLDS", {})
    monkeypatch.setenv("LPDIFF_BASELINES", str(tmp_path_factory.mktemp("store")))
    monkeypatch.setenv("LPDIFF_CHECK_CSV_DIR", str(out_dir))
    # the grid's model name picks its step options; the case is the tiny one
    grid_module.test_decode_vs_reference("qwen3-30b-a3b", "hf", "bfloat16", "seeded", tmp_path_factory)
    assert "on tiny-qwen3-moe: as expected\n" in capsys.readouterr().out
    with open(out_dir / "engines_gpu_decode.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == DECODE_CSV_COLUMNS
    assert {(r["lane"], r["expected"], r["verdict"]) for r in rows} == {
        *((lane, "PASS", "PASS") for lane in ("base", "all", "attention", "experts", "all_r8")),
        ("broken", "FAIL", "FAIL"),
    }
