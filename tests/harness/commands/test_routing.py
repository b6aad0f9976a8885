"""Routing capture, attribution and replay (issue 43) on the tiny zoo, CPU, real engines (hf and triton):

capture    hf and triton return the same expert ids per token and MoE layer in fp32 (except near-ties), in the
           documented shapes, for packed prompts with mixed adapters; the ids survive --save-runs' npz.
attribute  a router defect (renormalisation flipped against the config, a wrong expert for some tokens, the router
           bias rounded to bf16: HF hooks on the engine's routers) FAILs through the routing part and is named a
           router fault; a kernel defect (the triton bug zoo's lora_after_activation) is a kernel fault with routing
           agreeing; the definitions on hand-made runs.
replay     hf fp32 replaying its own ids reproduces itself bit for bit (every zoo arch); hf bf16 replaying the fp32
           run's ids sits closer to fp32 than unreplayed; lpdiff check --routing-replay on the triton runtime.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.pipeline.metrics import compare, near_tie_eps
from lpdiff.harness.pipeline.noise import Noise, threshold_from
from lpdiff.harness.pipeline.routing import apply, attribute, routing_html
from lpdiff.harness.pipeline.verdict import from_json, judge, to_json
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.spec.resolve import zoo_adapters
from lpdiff.harness.spec.routing import is_router
from lpdiff.harness.types import LogprobRun, PromptLogprobs

MOE = ("tiny-qwen3-moe", "tiny-gpt-oss")
ADAPTER = "all"
FP32 = ("float32",)


def _prompts(model: str) -> list[list[int]]:
    return [p[:n] for p, n in zip(prompt_set(model)[:4], (24, 40, 7, 33))]


def _run(
    engine: str, model: str, dtype: str = "float32", options: dict | None = None, defect=None, routing=None, choice=None
) -> LogprobRun:
    ads = zoo_adapters(model)
    prompts = _prompts(model)
    choice = choice if choice is not None else [ADAPTER, None, ADAPTER, None]
    cfg = EngineConfig(
        model=get_model(model),
        adapters={ADAPTER: ads[ADAPTER]},
        dtype=dtype,
        device="cpu",
        options={"capture_routing": True, **(options or {})},
    )
    with open_engine(engine, cfg) as eng:
        if defect is not None:
            defect(eng)
        return LogprobRun(
            eng.prompt_logprobs(prompts, choice, routing=routing)
            if routing is not None
            else eng.prompt_logprobs(prompts, choice),
            {"engine": engine, "dtype": dtype},
        )


@pytest.fixture(scope="module", params=MOE)
def ref(request):
    """(model, the hf fp32 reference run with routing)."""
    return request.param, _run("hf", request.param)


def _threshold():
    # fp32 between two correct implementations on the tiny zoo: k2 <= 8e-13, max |d| <= 1e-5 (NOTES.md), x 30
    t = threshold_from(Noise(k2=1e-12, max_abs=1e-5), 30.0, note="test")
    t.model, t.engine_pair, t.dtype, t.tp = "tiny", "x-vs-hf", "float32", 1
    return t


def _verdict(a: LogprobRun, b: LogprobRun, dtypes=FP32):
    t = _threshold()
    v = judge(compare(a, b, near_tie_eps(*dtypes)), t, adapter=ADAPTER)
    apply(v, attribute(a, b, dtypes, t))
    return v


# -- capture -------------------------------------------------------------------------------------------------------


def test_hf_and_triton_capture_the_same_experts(ref):
    model, hf = ref
    tr = _run("triton", model)
    cfg = get_model(model)
    from lpdiff.harness.spec.catalog import hf_config

    c = hf_config(cfg)
    L, K = c.num_hidden_layers, c.num_experts_per_tok
    for p, q, n in zip(hf.prompts, tr.prompts, (24, 40, 7, 33)):
        for x in (p, q):
            assert x.routed_experts.shape == (n, L, K) and x.routed_experts.dtype == np.int32
            assert x.routed_margins.shape == (n, L) and x.routed_weights.shape == (n, L, K)
            assert ((x.routed_experts >= 0) & (x.routed_experts < c.num_local_experts)).all()
        same = (np.sort(p.routed_experts, -1) == np.sort(q.routed_experts, -1)).all(-1)
        tie = np.minimum(p.routed_margins, q.routed_margins) < near_tie_eps("float32")
        assert (same | tie).all(), f"{model}: experts differ away from near-ties"
        np.testing.assert_allclose(q.routed_margins, p.routed_margins, atol=1e-5)
        order = np.argsort(p.routed_experts, -1), np.argsort(q.routed_experts, -1)
        np.testing.assert_allclose(
            np.take_along_axis(q.routed_weights, order[1], -1),
            np.take_along_axis(p.routed_weights, order[0], -1),
            atol=1e-5,
        )
    r = attribute(tr, hf, FP32, _threshold())
    assert r["token_agreement"] == 1.0 and r["fault"] is None and r["kernel_part"] == "PASS"


@pytest.mark.parametrize("model", ["tiny-qwen3.5-moe", "tiny-nemotron-h"])
def test_hybrids_capture_the_same_experts(model):
    """The hybrids' MoE layers only (Nemotron-H: 2 of its 6 layers), hf and triton alike."""
    hf, tr = _run("hf", model), _run("triton", model)
    r = attribute(tr, hf, FP32, _threshold())
    assert r["layers"] == (2 if model == "tiny-nemotron-h" else 4), r
    assert r["token_agreement"] == 1.0 and r["fault"] is None, r["summary"]
    for p, q in zip(hf.prompts, tr.prompts):
        np.testing.assert_allclose(q.routed_margins, p.routed_margins, atol=1e-5)


def test_routing_survives_the_saved_run(ref, tmp_path):
    _, hf = ref
    hf.save(tmp_path / "run.npz")
    back = LogprobRun.load(tmp_path / "run.npz")
    for p, q in zip(hf.prompts, back.prompts):
        np.testing.assert_array_equal(p.routed_experts, q.routed_experts)
        np.testing.assert_array_equal(p.routed_weights, q.routed_weights)
        np.testing.assert_array_equal(p.routed_margins, q.routed_margins)


def test_capture_is_off_by_default():
    model = MOE[0]
    cfg = EngineConfig(model=get_model(model), dtype="float32", device="cpu")
    with open_engine("hf", cfg) as eng:
        out = eng.prompt_logprobs(_prompts(model)[:1])
    assert out[0].routed_experts is None and out[0].router_margin is not None


# -- attribution ---------------------------------------------------------------------------------------------------


def _renormalise_flipped(eng):
    """The top-k weights renormalised where the config says not to, and not where it says to."""
    for m in eng.lm.modules():
        if is_router(m) and hasattr(m, "norm_topk_prob"):
            m.norm_topk_prob = not m.norm_topk_prob


def _wrong_expert(eng):
    """Every fifth token's last expert replaced by the next-ranked one (inside the router: before capture)."""

    def hook(mod, args, out):
        logits, weights, ids = out
        ids = ids.clone()
        ids[::5, -1] = logits.topk(ids.shape[1] + 1, dim=-1).indices[::5, -1]
        return logits, weights, ids

    for m in eng.lm.modules():
        if is_router(m):
            m.register_forward_hook(hook, prepend=True)


def _bias_bf16(eng):
    """gpt-oss's router bias rounded to bf16 in an fp32 run."""
    for m in eng.lm.modules():
        if is_router(m):
            m.bias.data = m.bias.data.bfloat16().float()


def test_router_defects_fail_as_router_faults(ref):
    model, hf = ref
    defects = {"wrong_expert": _wrong_expert}
    defects.update({"renormalise": _renormalise_flipped} if model == "tiny-qwen3-moe" else {"bias_bf16": _bias_bf16})
    for name, defect in defects.items():
        v = _verdict(_run("hf", model, defect=defect), hf)
        assert not v.passed, f"{model} {name}"
        assert v.routing["fault"] == "router fault" and v.routing["router_part"] == "FAIL", v.routing["summary"]
        assert any(r.startswith("router fault") for r in v.reasons), v.reasons


def test_kernel_defect_is_a_kernel_fault_with_routing_agreeing():
    model = "tiny-qwen3-moe"
    hf = _run("hf", model)
    v = _verdict(_run("triton", model, options={"fault": "lora_after_activation"}), hf)
    assert not v.passed
    r = v.routing
    assert r["token_agreement"] == 1.0 and r["router_part"] == "PASS", r["summary"]
    assert r["fault"] == "kernel fault" and r["kernel_part"] == "FAIL"
    # the verdict, with its routing part, goes through the JSON document and the HTML panel
    back = from_json(to_json([v]))[0]
    assert back.routing["fault"] == "kernel fault"
    panel = routing_html(json.loads(to_json([v]))["verdicts"][0]["routing"])
    assert "agreement per MoE layer" in panel and panel.count("<rect") == r["layers"]


def test_triton_zoo_router_fault_is_a_router_fault():
    """kernels/faults.py router_bias_rounded (Nemotron-H's correction bias rounded to 2 decimals): it moves the choice
    only, so the expert flips where a margin is below the rounding (one token of the default prompts) and nothing
    else; the kernel part passes on the routing-clean positions."""
    model = "tiny-nemotron-h"
    prompts = prompt_set(model)

    def run(options):
        cfg = EngineConfig(
            model=get_model(model), dtype="float32", device="cpu", options={"capture_routing": True, **options}
        )
        engine = "triton" if "fault" in options else "hf"
        with open_engine(engine, cfg) as eng:
            return LogprobRun(eng.prompt_logprobs(prompts))

    v = _verdict(run({"fault": "router_bias_rounded"}), run({}))
    r = v.routing
    assert not v.passed and r["fault"] == "router fault" and r["kernel_part"] == "PASS", r["summary"]
    assert r["flips_above_rounding"] >= 1 and r["token_agreement"] < 1.0


def _synthetic(ids_a, ids_b, margins=None, d=None):
    """One prompt of n tokens with given (n, L, K) ids; margins of the reference; d on positions."""
    n = ids_a.shape[0]
    toks = np.arange(n)
    lp = np.zeros(n - 1, np.float32)
    a = PromptLogprobs(toks, lp + (0 if d is None else d), routed_experts=ids_a)
    b = PromptLogprobs(
        toks,
        lp,
        routed_experts=ids_b,
        routed_margins=margins if margins is not None else np.ones(ids_b.shape[:2], np.float32),
    )
    return LogprobRun([a]), LogprobRun([b])


def test_definitions_on_made_runs():
    n, L = 8, 3
    base = np.tile(np.array([[0, 1]], np.int32), (n, L, 1))
    a = base.copy()
    a[3, 1] = [0, 2]  # token 3 flips at layer 1: first-order (nothing upstream of it differs)
    a[5, 2] = [1, 3]  # token 5, layer 2: after token 3's flip, so not first-order
    a[2, 0] = [1, 0]  # the same set in another order: agrees
    margins = np.ones((n, L), np.float32)
    margins[3, 1] = 1e-6  # below rounding
    d = np.zeros(n - 1, np.float32)
    d[4:] = 0.5  # large |d| only after the flip
    r = attribute(*_synthetic(a, base, margins, d), FP32, _threshold())
    assert r["per_layer_agreement"] == [1.0, 6 / 7, 6 / 7] and r["token_agreement"] == 5 / 7
    assert r["clean_positions"] == 3 and r["clean_max_abs"] == 0.0  # positions 0-2 see no flip
    assert r["first_order_flips"] == 1 and r["flips"] == [[0, 3, 1, pytest.approx(1e-6)]]
    assert r["router_part"] == "PASS" and r["fault"] is None  # one flip below rounding, kernels agree
    margins[3, 1] = 0.5  # the same flip at a decisive margin: the router's
    r = attribute(*_synthetic(a, base, margins, d), FP32, _threshold())
    assert r["flips_above_rounding"] == 1 and r["fault"] == "router fault"
    # the last token (no position sees it) and unreported rows (-1) are not judged
    a2 = base.copy()
    a2[n - 1] = [[4, 5]] * L
    a2[1] = -1
    assert attribute(*_synthetic(a2, base), FP32, _threshold())["token_agreement"] == 1.0
    with pytest.raises(ValueError, match="different \\(MoE layers, top_k\\)"):
        attribute(*_synthetic(base, base[:, :2]), FP32)
    assert attribute(LogprobRun([PromptLogprobs(np.arange(3), np.zeros(2))]), _synthetic(base, base)[1], FP32) is None


# -- replay --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-nemotron-h", "tiny-qwen3.5-moe"])
def test_replaying_its_own_ids_reproduces_hf_exactly(model):
    own = _run("hf", model)
    again = _run("hf", model, routing=[p.routed_experts for p in own.prompts])
    for p, q in zip(own.prompts, again.prompts):
        np.testing.assert_array_equal(p.logprobs, q.logprobs)
        np.testing.assert_array_equal(p.routed_weights, q.routed_weights)


def test_replay_refuses_ids_of_another_shape():
    model = MOE[0]
    own = _run("hf", model)
    with pytest.raises(ValueError, match="MoE layers"):
        _run("hf", model, routing=[p.routed_experts[:, :2] for p in own.prompts])


# (prompt of the zoo's default set, adapter) where HF bf16 routes a token differently from fp32 on this CPU
FLIPS = {"tiny-qwen3-moe": (0, "experts_per_expert"), "tiny-gpt-oss": (1, None)}


@pytest.mark.parametrize("model", MOE)
def test_bf16_replayed_with_fp32_ids_sits_closer_to_fp32(model, capsys):
    """On the tiny zoo bf16 flips a few experts (0.04-0.07 % of tokens over the default prompts and adapters); the
    bf16 run replaying the fp32 run's ids routes as fp32 everywhere and sits closer to it."""
    i, name = FLIPS[model]
    ads = zoo_adapters(model)
    prompts = [prompt_set(model)[i]]

    def run(dtype, routing=None):
        cfg = EngineConfig(
            model=get_model(model),
            adapters={name: ads[name]} if name else {},
            dtype=dtype,
            device="cpu",
            options={"capture_routing": True},
        )
        with open_engine("hf", cfg) as eng:
            return LogprobRun(eng.prompt_logprobs(prompts, name, routing=routing))

    fp32 = run("float32")
    plain, replayed = run("bfloat16"), run("bfloat16", routing=[p.routed_experts for p in fp32.prompts])
    flips = attribute(plain, fp32, ("bfloat16", "float32"))["first_order_flips"]
    assert attribute(replayed, fp32, ("bfloat16", "float32"))["token_agreement"] == 1.0
    m0, m1 = compare(plain, fp32), compare(replayed, fp32)
    with capsys.disabled():
        print(
            f"\n{model} bf16 vs fp32 ({flips} first-order flips): k2 {m0.k2:.3g} -> {m1.k2:.3g} replayed, "
            f"max |d| {m0.max_abs:.3g} -> {m1.max_abs:.3g} ({m0.max_abs / m1.max_abs:.2f}x)"
        )
    if flips:  # the flip sits on this CPU's bf16 rounding: another ISA may route that token as fp32 does
        assert m1.max_abs < m0.max_abs and m1.k2 < m0.k2
    else:
        assert m1.max_abs <= m0.max_abs


def test_check_with_routing_replay_on_the_triton_runtime(tmp_path):
    from lpdiff.harness.commands import check
    from lpdiff.harness.commands.replay import replay_check

    case = check.build_case(
        "tiny-qwen3-moe", 2, tmp_path / "case", device="cpu", lengths=(40, 23), layouts=("peft3d",), log=lambda s: None
    )
    res = replay_check(check.CheckRequest(case, "triton", k=2, dtype="bfloat16"), log=lambda s: None)
    assert res.as_expected, check.format_result(res)
    assert res.engine_pair == "triton:bfloat16-vs-hf[replay]:float32"
    assert all(v.routing is not None and v.routing["kernel_judged_on"] == "routing replay" for v in res.verdicts)
    broken = next(v for v in res.verdicts if v.adapter == "broken.peft3d")
    assert broken.routing["fault"] == "kernel fault", broken.reasons
    with pytest.raises(ValueError, match="use --reference hf"):
        from lpdiff.harness.commands.replay import checker

        checker(True, "triton", None)


def test_replay_and_capture_options_are_checked():
    with pytest.raises(ValueError, match="capture_routing"):
        _run("triton", MOE[0], options={"capture_routing": "yes"})
