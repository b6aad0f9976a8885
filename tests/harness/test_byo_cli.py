"""Bring your own model, adapter and prompts, as a new user would: copies of a zoo model and adapter in a temp dir
(or in an HF cache laid out as huggingface_hub writes it, HF_HUB_OFFLINE=1), `lpdiff regen` then `lpdiff run
--engine triton` -> a verdict table, exit 0; bad inputs -> exit 2 and nothing written."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from lpdiff.harness.cli import main
from lpdiff.harness.spec.catalog import ZOO_DIR
from tests.helpers.hf_cache import offline_home, populate
from tests.helpers.paths import REPO

MODEL = "tiny-qwen3-moe"
ZOO_ADAPTERS = REPO / "harness" / "zoo_adapters"


@pytest.fixture
def user(monkeypatch, tmp_path):
    """A model and an adapter copied out of lpdiff, an empty store path, an offline HF cache."""
    hub = offline_home(monkeypatch, tmp_path)
    shutil.copytree(ZOO_DIR / MODEL, tmp_path / "model")
    shutil.copytree(ZOO_ADAPTERS / MODEL / "all", tmp_path / "adapter")
    return tmp_path, hub


def _lpdiff(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _regen_then_run(capsys, store, *sel):
    rc, out, err = _lpdiff(capsys, "regen", *sel, "--baselines", store)
    assert rc == 0, err
    rc, out, err = _lpdiff(capsys, "run", *sel, "--engine", "triton", "--baselines", store)
    assert rc == 0, err
    assert "triton:float32-vs-hf:float32" in out and "PASS" in out and "FAIL" not in out
    return out


def test_local_dirs(user, capsys):
    tmp, _ = user
    out = _regen_then_run(capsys, tmp / "B", "--model", tmp / "model", "--adapter", tmp / "adapter")
    assert " adapter " in out and len(list((tmp / "B").rglob("*.parquet"))) == 2  # base + adapter


def test_hub_ids_and_prompts_file(user, capsys):
    tmp, hub = user
    _, commit = populate(hub, "acme/tiny-moe", tmp / "model")
    populate(hub, "acme/tiny-moe-lora", tmp / "adapter", repo_type="dataset")
    prompts = tmp / "p.jsonl"
    prompts.write_text(
        json.dumps({"text": "def mul(a, b):\n    return a * b\n"})
        + "\n"
        + json.dumps({"token_ids": [5, 17, 300, 42, 9, 801, 3, 77]})
        + "\n"
    )
    out = _regen_then_run(
        capsys,
        tmp / "B",
        "--model",
        f"acme/tiny-moe@{commit}",
        "--adapter",
        "hf://datasets/acme/tiny-moe-lora",
        "--prompts",
        prompts,
    )
    assert "acme/tiny-moe@" in out and "tiny-moe-lora" in out


def _bad_inputs(tmp):
    other = ZOO_ADAPTERS / "tiny-qwen3.5-moe" / "attention"
    (tmp / "empty").mkdir()
    oov = tmp / "oov.jsonl"
    oov.write_text('{"token_ids": [1, 2, 99999]}\n')
    return {
        "missing repo": (["--model", "acme/nope"], "hf download acme/nope"),
        "unknown revision": (["--model", "acme/tiny-moe@v9"], "--revision v9"),
        "no config.json": (["--model", tmp / "empty"], "has no config.json"),
        "no adapter_config.json": (
            ["--model", tmp / "model", "--adapter", tmp / "empty"],
            "has no adapter_config.json",
        ),
        "adapter for another architecture": (["--model", tmp / "model", "--adapter", other], "attention"),
        "out-of-vocabulary prompt": (["--model", tmp / "model", "--prompts", oov], "oov.jsonl line 1"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing repo",
        "unknown revision",
        "no config.json",
        "no adapter_config.json",
        "adapter for another architecture",
        "out-of-vocabulary prompt",
    ],
)
def test_bad_input_exit_2_nothing_written(user, capsys, case):
    tmp, hub = user
    populate(hub, "acme/tiny-moe", tmp / "model")
    args, says = _bad_inputs(tmp)[case]
    for command in ("regen", "run"):
        rc, _out, err = _lpdiff(capsys, command, *args, "--engine", "hf", "--baselines", tmp / "B")
        assert rc == 2, (case, command, err)
        assert says in err and err.count("error:") == 1 and "Traceback" not in err
        assert not (tmp / "B").exists()


def test_doctor_error_stops_the_run_and_its_fix_runs_as_printed(user, capsys, tmp_path):
    """The doctor runs on the user's adapters before any engine starts; each fix command it prints runs as printed
    (here: vLLM's PEFT 3D finding on qwen3_moe, fixed by `lpdiff adapters convert --model DIR ...`)."""
    from lpdiff.harness.commands.preflight import preflight
    from lpdiff.harness.spec.resolve import SpecError, resolve

    tmp, _ = user
    r = resolve(str(tmp / "model"), [str(tmp / "adapter")], weights=False)
    with pytest.raises(SpecError, match="lpdiff doctor found") as e:
        preflight(r, ["vllm"])
    fixes = [line.split("-- fix: ", 1)[1] for line in str(e.value).splitlines() if "-- fix: " in line]
    commands = [
        f[f.index("lpdiff adapters convert") :].split("`")[0].rstrip(".; ")
        for f in fixes
        if "lpdiff adapters convert" in f
    ]
    assert commands, fixes
    for i, cmd in enumerate(commands):
        argv = shlex.split(cmd.replace(" OUT ", f" {tmp / f'out{i}'} "))[1:]
        rc, _out, err = _lpdiff(capsys, *argv)
        assert rc == 0, (cmd, err)
        assert (tmp / f"out{i}" / "adapter_config.json").is_file()
    preflight(r, ["triton"])  # the engines lpdiff's doctor does not know: only "does it fit the model" gates


def test_adapters_gen_on_a_directory(user, capsys):
    tmp, _ = user
    rc, _out, err = _lpdiff(capsys, "adapters", "gen", "--model", tmp / "model", "--out", tmp / "gen", "--rank", "4")
    assert rc == 0, err
    assert json.loads((tmp / "gen" / "adapter_config.json").read_text())["r"] == 4
