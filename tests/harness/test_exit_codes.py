"""README's exit-code table is what the CLI does: one case per row, run through the real entry point."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import lpdiff
from lpdiff.harness import cli
from lpdiff.harness.cli import main
from tests.helpers.paths import REPO

README = REPO / "README.md"


def readme_codes() -> set[int]:
    section = README.read_text().split("### Exit codes", 1)[1].split("\n#", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d) \|", section, flags=re.MULTILINE)}


def test_readme_documents_exactly_the_codes_main_returns():
    assert readme_codes() == {cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_CRASH} == {0, 1, 2, 3}


def test_version_is_the_package_version():
    out = subprocess.run(
        [sys.executable, "-m", "lpdiff.harness.cli", "--version"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and lpdiff.__version__ in out.stdout


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["run", "--option", "foo"], "KEY=VALUE"),  # a malformed option
        (["run", "--dtype", "float8"], "float8"),  # a value click refuses
        (["compare"], "--model"),  # nothing to compare
        (["run", "--engine", "no-such-engine"], "unknown engine"),
        (["run", "--engine", "vllm"], "pip install vllm=="),  # not installed here: the command that installs it
        (["run", "--model", "no-such-model"], "no-such-model"),
        (["run", "--model", "tiny-qwen3-moe", "--option", "no_such_option=1"], "no_such_option"),
        # a TP size the model's heads do not split over (tiny Qwen3.5: 2 linear-attention key heads)
        (["run", "--model", "tiny-qwen3.5-moe", "--engine", "triton", "--tp", "4"], "use --tp 1 or 2"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle, capsys, monkeypatch):
    if argv[-1] == "vllm" and __import__("importlib").util.find_spec("vllm"):
        pytest.skip("vllm is installed here")
    assert main(argv) == 2
    captured = capsys.readouterr()
    text = captured.err + captured.out
    assert needle in text and "Traceback" not in text and "lpdiff[" not in text  # lpdiff is not on PyPI


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


@pytest.mark.parametrize("error", [KeyError, ValueError, OSError, TypeError])
def test_a_builtin_error_inside_a_stage_is_a_bug_exit_3(error, monkeypatch, capsys):
    """Only InputError (spec/errors.py) means bad input: lpdiff's own KeyError or ValueError in a stage is a bug,
    reported with its traceback, never as one line of "bad input"."""

    def stage(*a, **k):
        raise error("adapter_groups")  # what a missing dict key in lpdiff's own code raises

    monkeypatch.setattr("lpdiff.harness.commands.run.preflight", stage)
    assert main(["run", "--model", "tiny-qwen3-moe", "--engine", "hf", "--tp", "1"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and f"{error.__name__}: " in err and "bug" in err.splitlines()[-1]


def test_help_and_version_import_no_torch():
    """`lpdiff --help`, `lpdiff run --help` and `--version` answer without importing torch (seconds of start-up)
    or numpy: the command modules are imported when a command runs."""
    code = (
        "import sys, contextlib, io\n"
        "from lpdiff.harness.cli import main\n"
        "for argv in (['--help'], ['--version'], ['run', '--help'], ['baselines', '--help'],\n"
        "             ['check', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'pyarrow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_missing_triton_exits_2_naming_the_install():
    """Where triton cannot be imported (a wheel on macOS) the default job, which runs the triton engine, is bad input
    naming the install command (and the self-check that runs without it), never a crash (exit 3)."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton raises ImportError, as where it is not installed\n"
        "from lpdiff.harness.cli import main\n"
        "sys.exit(main(['run']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    assert "pip install triton==" in out.stderr and "lpdiff run --engine hf" in out.stderr
    assert "Traceback" not in out.stderr


def test_readme_exit_code_examples_exit_with_their_code(capsys):
    """Row 1's example, as README prints it, FAILs (a planted bug-zoo fault in the triton engine)."""
    import shlex

    section = README.read_text().split("### Exit codes", 1)[1].split("\n#", 1)[0]
    row = next(ln for ln in section.splitlines() if ln.startswith("| 1 |"))
    example = re.findall(r"`([^`]+)`", row.split("|")[3])[0]
    argv = shlex.split(example)
    assert argv[0] == "lpdiff" and "fault=" in example
    assert main(argv[1:]) == 1
