"""README's exit-code table is what the CLI does: one case per row, run through the real entry point."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import lpdiff
from lpdiff.harness import cli
from lpdiff.harness.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_codes() -> set[int]:
    section = README.read_text().split("### Exit codes", 1)[1].split("\n#", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d) \|", section, flags=re.M)}


def test_readme_documents_exactly_the_codes_main_returns():
    assert readme_codes() == {cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_CRASH} == {0, 1, 2, 3}


def test_version_is_the_package_version():
    out = subprocess.run([sys.executable, "-m", "lpdiff.harness.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and lpdiff.__version__ in out.stdout


@pytest.mark.parametrize("argv,needle", [
    (["run", "--option", "foo"], "KEY=VALUE"),  # a malformed option
    (["run", "--dtype", "float8"], "float8"),  # a value click refuses
    (["compare"], "--model"),  # nothing to compare
    (["run", "--engine", "no-such-engine"], "unknown engine"),
    (["run", "--engine", "vllm"], "pip install"),  # not installed here: the message names the extra
    (["run", "--model", "no-such-model"], "no-such-model"),
    (["run", "--model", "tiny-qwen3-moe", "--option", "no_such_option=1"], "no_such_option"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys, monkeypatch):
    if argv[-1] == "vllm" and __import__("importlib").util.find_spec("vllm"):
        pytest.skip("vllm is installed here")
    assert main(argv) == 2
    captured = capsys.readouterr()
    text = captured.err + captured.out
    assert needle in text and "Traceback" not in text


def test_missing_baseline_exits_2(tmp_path, capsys):
    assert main(["run", "--model", "tiny-qwen3-moe", "--adapter", "attention", "--baselines", str(tmp_path)]) == 2
    assert "lpdiff regen" in capsys.readouterr().err


def test_a_crash_exits_3_with_the_traceback(monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr("lpdiff.harness.commands.run.run_job", boom)
    assert main(["run", "--model", "tiny-qwen3-moe"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "simulated bug" in err and "bug" in err.splitlines()[-1]
