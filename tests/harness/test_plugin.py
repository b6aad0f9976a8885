"""The pytest plugin as a user meets it: markers, GPU skips with a reason, the --lpdiff-regen option."""

import importlib.util

import pytest

pytest_plugins = "pytester"


def test_markers_registered_and_gpu_tests_skipped_with_reason(pytester, monkeypatch):
    monkeypatch.setattr("lpdiff.harness.plugin.gpu_count", lambda: 1)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu1
        def test_one(): pass

        @pytest.mark.gpu8
        def test_eight(): pass

        @pytest.mark.cpu
        def test_cpu(): pass
        """
    )
    res = pytester.runpytest("--strict-markers", "-rs")
    res.assert_outcomes(passed=2, skipped=1)
    res.stdout.fnmatch_lines(["*needs 8 GPUs, this machine has 1*"])
    # -m gpu8 selects exactly the 8-GPU suite
    res = pytester.runpytest("--strict-markers", "-m", "gpu8", "-rs")
    res.assert_outcomes(skipped=1, deselected=2)


def test_regen_option_and_verdict_table(pytester):
    pytester.makepyfile(
        """
        from lpdiff.harness.pipeline.thresholds import Threshold
        from lpdiff.harness.pipeline.verdict import judge
        from lpdiff.harness.pipeline.metrics import Metrics

        def test_regen(lpdiff_regen):
            assert lpdiff_regen

        def test_table(record_verdict):
            import numpy as np
            from lpdiff.harness.types import LogprobRun, PromptLogprobs
            from lpdiff.harness.pipeline.metrics import compare
            from lpdiff.harness.pipeline.thresholds import lookup
            a = LogprobRun([PromptLogprobs(np.arange(4), np.array([-1.0, -2.0, -0.5]))])
            b = LogprobRun([PromptLogprobs(np.arange(4), np.array([-1.0, -2.5, -0.5]))])
            v = judge(compare(a, b), lookup("tiny-x", "hf:float32-vs-hf:float32", "float32", 1))
            v.model, v.engine_pair, v.adapter = "tiny-x", "hf-vs-hf", "-"
            record_verdict(v)
            assert not v.passed
        """
    )
    res = pytester.runpytest("--lpdiff-regen")
    res.assert_outcomes(passed=2)
    res.stdout.fnmatch_lines(["*lpdiff verdicts*", "*tiny-x*FAIL*"])


def test_header_says_when_engine_processes_would_compile_torch_from_source(pytester, monkeypatch, tmp_path):
    """The header line appears only when torch has no bytecode where Python looks and none would be written: here an
    empty PYTHONPYCACHEPREFIX with PYTHONDONTWRITEBYTECODE=1 (what an image built with uv looks like), in a fresh
    interpreter, since Python reads both variables at start-up."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    pytester.makepyfile("def test_ok():\n    pass\n")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "empty-pyc"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    res = pytester.runpytest_subprocess()
    res.assert_outcomes(passed=1)
    res.stdout.fnmatch_lines(["lpdiff: torch has no bytecode and PYTHONDONTWRITEBYTECODE is set*"])
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    res = pytester.runpytest_subprocess()
    res.assert_outcomes(passed=1)
    res.stdout.no_fnmatch_line("*torch has no bytecode*")


def test_bytecode_note_only_when_nothing_is_cached_or_written():
    from lpdiff.harness.plugin import bytecode_note

    assert bytecode_note(True, False) and "docs/engines.md" in bytecode_note(True, False)
    assert bytecode_note(False, False) is None  # the first import writes it
    assert bytecode_note(True, True) is None and bytecode_note(True, None) is None  # cached; torch not installed
