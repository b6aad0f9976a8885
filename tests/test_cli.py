"""The lpdiff CLI end to end on the tiny zoo: regen/run round trip, clear errors, and planted faults caught."""
import itertools

import pytest

from lpdiff.harness.spec import mutations
from lpdiff.harness.cli import main
from lpdiff.harness.spec.resolve import zoo_adapters


def test_models_lists_catalog_with_shapes(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen3-moe" in out and "qwen3-30b-a3b" in out and "2048" in out


def test_missing_baseline_names_the_regen_command(tmp_path, capsys):
    rc = main(["run", "--model", "tiny-qwen3-moe", "--adapter", "experts", "--baselines", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "lpdiff regen" in err and "tiny-qwen3-moe" in err


def test_regen_then_run_passes_and_saves_runs(tmp_path, capsys):
    sel = ["--model", "tiny-gpt-oss", "--adapter", "attention", "--baselines", str(tmp_path / "b")]
    assert main(["regen", *sel]) == 0
    capsys.readouterr()
    assert main(["run", *sel, "--save-runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("tiny-gpt-oss ")]
    assert len(rows) == 2 and all(r[-1] == "PASS" for r in rows) and "FAIL" not in out
    assert "expected PASS" in out.splitlines()[0]  # what every row shares: one line above the table
    saved = sorted((tmp_path / "runs").glob("*.npz"))
    assert len(saved) == 2
    # two stored runs compared: base vs adapter differ far beyond any fp32 threshold
    assert main(["compare", "--runs", str(saved[0]), str(saved[1]), "--allow-different"]) == 1


# Each planted fault is a real mechanism an engine gets wrong; the verdict must FAIL and name what moved.
@pytest.mark.parametrize("model,mutation,kwargs", [
    ("tiny-qwen3-moe", "zero_expert", {"expert": 3}),  # one expert's LoRA silently dropped
    ("tiny-gpt-oss", "scale_experts", {"factor": 2.0}),  # expert LoRA applied with the wrong scale
    ("tiny-qwen3.5-moe", "permute_experts", {"shift": 1}),  # expert adapters in the wrong order
])
def test_planted_fault_fails_compare_and_names_delta_fidelity(model, mutation, kwargs, tmp_path, capsys):
    broken = mutations.MUTATIONS[mutation](zoo_adapters(model)["experts"].path, tmp_path / "broken", **kwargs)
    rc = main(["compare", "--model", model, "--adapter", "experts", "--test-adapter-dir", str(broken)])
    out = capsys.readouterr().out
    assert rc == 1, out
    row = next(line for line in out.splitlines() if " experts " in line)
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("FAIL") and " experts: " in line)
    reason = " ".join([lines[i], *(ln.strip() for ln in itertools.takewhile(lambda ln: ln.startswith("    "),
                                                                           lines[i + 1:]))])  # below the table
    assert "FAIL" in row and "delta fidelity" in reason
    base_row = next(line for line in out.splitlines() if line.startswith(model) and "  -  " in line)
    assert "PASS" in base_row  # the base model is untouched by an adapter fault


def test_cli_layout_choices_are_the_adapter_layouts():
    from lpdiff.harness import cli
    from lpdiff.harness.spec.adapters import LAYOUTS

    assert tuple(cli.LAYOUTS.choices) == LAYOUTS


def test_check_refuses_an_unknown_init_recipe_before_building_anything(capsys):
    from lpdiff.harness.cli import main

    rc = main(["check", "--engine", "hf", "--model", "qwen3-30b-a3b", "--layers", "1", "--device", "cpu",
               "--init-recipe", "peaked/v0"])
    assert rc == 2 and "peaked/v1" in capsys.readouterr().err


def test_adapters_convert_writes_under_the_disk_root(tmp_path, capsys):
    """--disk-root writes the decoder's modules under the checkpoint's root (vLLM reads Qwen3.5's adapter names
    there); a root the model's readers do not know is refused with the ones they do, exit 2."""
    from safetensors import safe_open

    src = str(zoo_adapters("tiny-qwen3.5-moe")["all"].path)
    conv = ["adapters", "convert", "--model", "tiny-qwen3.5-moe", src]
    assert main([*conv, str(tmp_path / "r"), "--to", "peft3d", "--disk-root", "model.language_model"]) == 0
    with safe_open(str(tmp_path / "r" / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    with safe_open(f"{src}/adapter_model.safetensors", framework="pt") as f:
        want = sorted(k.replace("base_model.model.model.", "base_model.model.model.language_model.")
                      for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    assert sorted(keys) == want
    assert main([*conv, str(tmp_path / "b"), "--to", "peft3d", "--disk-root", "backbone"]) == 2
    err = capsys.readouterr().err
    assert "'backbone'" in err and "model or model.language_model" in err and not (tmp_path / "b").exists()
