"""`lpdiff run` as one request resolved once into a plan (commands/run.py), a verdict built once with its lane's
identity (pipeline/verdict.py judge), and the engine facts the harness reads from each engine's Capabilities."""

import pytest

from lpdiff.engines import ENGINES, capabilities
from lpdiff.harness.commands import run as run_mod
from lpdiff.harness.pipeline.metrics import Metrics
from lpdiff.harness.pipeline.thresholds import Threshold
from lpdiff.harness.pipeline.verdict import LaneId, judge


def _metrics(k2: float) -> Metrics:
    return Metrics(
        num_positions=100,
        k1=0.0,
        k2=k2,
        k3=k2,
        max_abs=1e-4,
        mean_abs=1e-5,
        p99_abs=5e-5,
        over_0_1=0.0,
        over_0_5=0.0,
        over_1_0=0.0,
        num_nonfinite=0,
    )


def test_plan_resolves_each_model_once_for_all_its_tp_sizes(monkeypatch):
    """Two TP sizes of one model: spec/resolve.py's resolve runs once, and both jobs carry that one resolution
    (run_job and judge_runs read it instead of resolving again)."""
    calls = []
    real = run_mod.resolve

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "resolve", counted)
    plan = run_mod.plan(run_mod.RunRequest(models=("tiny-qwen3-moe",), engine="hf", tps=(1, 1, 2)))
    assert calls == ["tiny-qwen3-moe"]
    assert [j.tp for j in plan.jobs] == [1, 2] and plan.jobs[0].resolved is plan.jobs[1].resolved is not None
    assert run_mod.resolve_job(plan.jobs[1]) is plan.jobs[0].resolved and calls == ["tiny-qwen3-moe"]


def test_plan_skips_models_the_engine_cannot_serve_and_refuses_when_none_is_left():
    from lpdiff.harness.spec.errors import UsageError

    plan = run_mod.plan(run_mod.RunRequest(models=("tiny-qwen3-moe",), engine="hf", tps=(1,)))
    assert plan.engine == "hf" and plan.skipped == []
    with pytest.raises(UsageError, match="unknown engine"):
        run_mod.plan(run_mod.RunRequest(engine="no-such-engine"))


def test_judge_builds_the_verdict_with_the_lanes_identity():
    """The identity comes from the lane, not the threshold (a measured threshold of another lane may be reused);
    the next step is kept only where the lane failed; a batch's per-group fidelity is named."""
    t = Threshold(
        k2=1e-6,
        max_abs=1e-3,
        delta_fidelity=0.05,
        source="unmeasured",
        model="other",
        engine_pair="x-vs-y",
        dtype="bfloat16",
        tp=4,
    )
    lane = LaneId("tiny-qwen3-moe", "triton:float32-vs-hf:float32", "float32", 2, "all")
    ok = judge(_metrics(1e-9), t, 0.01, lane=lane, groups={"attention": 0.01}, next_step="lpdiff bisect ...")
    assert (ok.model, ok.engine_pair, ok.dtype, ok.tp, ok.adapter) == (
        "tiny-qwen3-moe",
        lane.engine_pair,
        "float32",
        2,
        "all",
    )
    assert ok.passed and ok.next_step == "" and any("attention 0.01" in n for n in ok.notes)
    bad = judge(_metrics(1e-9), t, 0.5, lane=lane, groups={"attention": 0.9, "experts": 0.01}, next_step="NEXT")
    assert not bad.passed and bad.next_step == "NEXT"
    assert any(r.startswith("delta fidelity [attention] 0.9") for r in bad.reasons)
    assert not any("[experts]" in r for r in bad.reasons)
    base = judge(_metrics(float("nan")), t, lane=LaneId("m", "p", "float32", 1, "-"))
    assert base.adapter == "-" and not base.passed


def test_every_installable_engine_names_its_install_and_its_noise_twins():
    """What the harness used to spell per engine name (session.py's install commands, noise.py's fp32 twins, the
    doctor's engine list) is each engine's own declaration."""
    from lpdiff.harness.commands.doctor import ENGINES as DOCTOR_ENGINES
    from lpdiff.harness.pipeline.noise import noise_pair

    for name in ENGINES:
        c = capabilities(name)
        assert bool(c.install) == bool(c.module), name  # an engine with its own package says how to install it
        assert (name in DOCTOR_ENGINES) == c.adapter_doctor
    assert capabilities("hf").module == "" and "pip install vllm==" in capabilities("vllm").install
    assert noise_pair("triton", "float32") == (("float32", {"impl": "torch"}), ("float32", {}))
    assert noise_pair("hf", "bfloat16") == (("bfloat16", {}), ("float32", {}))


def test_engine_missing_reads_the_install_command_from_capabilities(monkeypatch):
    from lpdiff.harness.pipeline import session

    monkeypatch.setattr(session.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("LPDIFF_SGLANG_PYTHONPATH", raising=False)
    monkeypatch.delenv("LPDIFF_SGLANG_OPTIONS", raising=False)
    why = session.engine_missing("sglang")
    assert capabilities("sglang").install in why and "LPDIFF_SGLANG_PYTHONPATH" in why
    assert session.engine_missing("hf") is None
