"""The lpdiff CLI end to end on the tiny zoo: regen/run round trip, clear errors, and planted faults caught."""

import itertools
import json
import re
import shlex

import pytest

from lpdiff.harness.cli import main
from lpdiff.harness.spec import mutations
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
    sel = ["--model", "tiny-gpt-oss", "--adapter", "attention", "--baselines", str(tmp_path / "b"), "--engine", "hf"]
    assert main(["regen", *sel]) == 0
    capsys.readouterr()
    assert main(["run", *sel, "--save-runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("tiny-gpt-oss ")]
    assert len(rows) == 2 and all(r[-1] == "PASS" for r in rows) and "FAIL" not in out
    # what the verdicts prove, then what every row shares: two lines above the table
    assert out.splitlines()[0].startswith("install self-check: hf (float32) against its own stored reference runs")
    assert "expected PASS" in out.splitlines()[1]
    assert main(["run", *sel, "--wide"]) == 0  # every column in the rows
    assert all(
        "hf:float32-vs-hf:float32" in ln
        for ln in capsys.readouterr().out.splitlines()
        if ln.startswith("tiny-gpt-oss ")
    )
    saved = sorted((tmp_path / "runs").glob("*.npz"))
    assert len(saved) == 2
    # two stored runs compared: base vs adapter differ far beyond any fp32 threshold
    assert main(["compare", "--runs", str(saved[0]), str(saved[1]), "--allow-different"]) == 1


# Each planted fault is a real mechanism an engine gets wrong; the verdict must FAIL and name what moved.
@pytest.mark.parametrize(
    "model,mutation,kwargs",
    [
        ("tiny-qwen3-moe", "zero_expert", {"expert": 3}),  # one expert's LoRA silently dropped
        ("tiny-gpt-oss", "scale_experts", {"factor": 2.0}),  # expert LoRA applied with the wrong scale
        ("tiny-qwen3.5-moe", "permute_experts", {"shift": 1}),  # expert adapters in the wrong order
    ],
)
def test_planted_fault_fails_compare_and_names_delta_fidelity(model, mutation, kwargs, tmp_path, capsys):
    broken = mutations.MUTATIONS[mutation](zoo_adapters(model)["experts"].path, tmp_path / "broken", **kwargs)
    rc = main(["compare", "--model", model, "--adapter", "experts", "--test-adapter-dir", str(broken)])
    out = capsys.readouterr().out
    assert rc == 1, out
    row = next(line for line in out.splitlines() if " experts " in line)
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("FAIL") and " experts: " in line)
    reason = " ".join(
        [lines[i], *(ln.strip() for ln in itertools.takewhile(lambda ln: ln.startswith("    "), lines[i + 1 :]))]
    )  # below the table
    assert "FAIL" in row and "delta fidelity" in reason
    base_row = next(line for line in out.splitlines() if line.startswith(model) and "  -  " in line)
    assert "PASS" in base_row  # the base model is untouched by an adapter fault


def test_cli_layout_choices_are_the_adapter_layouts():
    from lpdiff.harness import cli
    from lpdiff.harness.spec.adapters import LAYOUTS

    assert tuple(cli.LAYOUTS.choices) == LAYOUTS


def test_check_refuses_an_unknown_init_recipe_before_building_anything(capsys):
    from lpdiff.harness.cli import main

    rc = main(
        [
            "check",
            "--engine",
            "hf",
            "--model",
            "qwen3-30b-a3b",
            "--layers",
            "1",
            "--device",
            "cpu",
            "--init-recipe",
            "peaked/v0",
        ]
    )
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
        want = sorted(k.replace("base_model.model.model.", "base_model.model.model.language_model.") for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    assert sorted(keys) == want
    assert main([*conv, str(tmp_path / "b"), "--to", "peft3d", "--disk-root", "backbone"]) == 2
    err = capsys.readouterr().err
    assert "'backbone'" in err and "model or model.language_model" in err and not (tmp_path / "b").exists()


def _files(root):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_the_regen_hint_is_the_command_that_fixes_that_run(tmp_path, capsys):
    """A run on its own store, its own prompts file and a depth cut finds no baseline: the command its error
    prints, followed literally, makes the same run pass, and the baselines shipped in the checkout stay as they
    were (a hint without --baselines regenerated into them and left the error standing)."""
    from lpdiff.harness.pipeline.references import PACKAGE_BASELINES

    shipped = _files(PACKAGE_BASELINES)
    prompts = tmp_path / "my prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [3 + i, 17, 5 * i + 1, 40, 9, 2]}) + "\n" for i in range(3)))
    run = [
        "run",
        "--engine",
        "hf",
        "--model",
        "tiny-qwen3-moe",
        "--adapter",
        "experts",
        "--num-layers",
        "1",
        "--prompts",
        str(prompts),
        "--baselines",
        str(tmp_path / "my store"),
    ]
    assert main(run) == 2
    hint = re.search(r"`(lpdiff regen [^`]*)`", capsys.readouterr().err).group(1)
    argv = shlex.split(hint)
    assert argv[0] == "lpdiff" and "--baselines" in argv and "--prompts" in argv and "--num-layers" in argv
    assert main(argv[1:]) == 0
    capsys.readouterr()
    assert main(run) == 0, capsys.readouterr().err
    assert _files(PACKAGE_BASELINES) == shipped


def test_the_regen_hint_names_the_store_from_the_environment(tmp_path, monkeypatch):
    from lpdiff.harness.commands.run import Job

    monkeypatch.setenv("LPDIFF_BASELINES", str(tmp_path / "env store"))
    assert f"--baselines '{tmp_path / 'env store'}'" in Job(model="tiny-qwen3-moe").regen_command()
    assert "--baselines /x" in Job(model="tiny-qwen3-moe", baselines="/x").regen_command()
    # a run judged against triton's bf16 runs is fixed by regenerating those, not HF's fp32 ones
    cmd = Job(model="tiny-qwen3-moe", engine="hf", reference="triton", ref_dtype="bfloat16").regen_command()
    assert "--reference triton --ref-dtype bfloat16" in cmd


def test_plain_run_judges_the_triton_engine_and_hf_is_the_self_check(monkeypatch, capsys):
    """What each command line computes (the jobs run_job is handed): plain `lpdiff run` is the triton engine
    against the stored hf runs at TP 1 and 2; `--engine hf` is said to be the install self-check; `regen` computes
    the reference engine's runs at TP 1 and runs no engine under test."""
    from lpdiff.harness.commands import run as run_mod

    seen = []

    def fake_run_job(job, store=None, regen=False, log=None):
        seen.append((job.engine, job.reference, job.tp, regen))
        return run_mod.JobResult(job, {}, {}, [])

    monkeypatch.setattr(run_mod, "run_job", fake_run_job)
    assert main(["run", "--model", "tiny-qwen3-moe"]) == 0
    assert seen == [("triton", "hf", tp, False) for tp in run_mod.default_tps("triton")]  # (1, 2) on a CPU
    assert capsys.readouterr().out.startswith("triton (float32) judged against the stored hf (float32) reference runs")
    seen.clear()
    assert main(["run", "--model", "tiny-qwen3-moe", "--engine", "hf"]) == 0
    assert seen == [("hf", "hf", 1, False)] and capsys.readouterr().out.startswith("install self-check: hf")
    seen.clear()
    assert main(["regen", "--model", "tiny-qwen3-moe"]) == 0
    assert seen == [("hf", "hf", 1, True)]
