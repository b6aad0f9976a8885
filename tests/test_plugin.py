"""The pytest plugin as a user meets it: markers, GPU skips with a reason, the --lpdiff-regen option."""

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
