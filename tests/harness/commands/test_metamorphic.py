"""lpdiff.harness.commands.metamorphic: the transformations are exact, the judge flags what it should, not-applicable
relations say why, and planted faults (a converter reading gpt-oss's interleaved gate/up as concatenated; an engine load
path that drops an expert) make the relation that covers them FAIL far above the calibrated factor."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from lpdiff.harness.commands import metamorphic as mm
from lpdiff.harness.commands import relations as rel
from lpdiff.harness.spec import adapters as ad
from lpdiff.harness.spec import transforms as tf
from lpdiff.harness.spec.catalog import get_model, hf_config
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.spec.resolve import zoo_adapters
from lpdiff.harness.types import LogprobRun, PromptLogprobs


def _ctx(model: str, adapter: str, tmp_path, engine: str = "triton") -> mm.Context:
    spec = get_model(model)
    hf = hf_config(spec)
    layout = ad.ModelLayout.from_config(hf)
    path = zoo_adapters(model)[adapter].path
    return rel.Context(engine, spec, hf, layout, ad.load_canonical(path, layout), Path(path), tmp_path)


def _deltas(adapter: ad.CanonicalAdapter) -> dict[str, torch.Tensor]:
    return {n: adapter.delta(n) for n in [*adapter.dense, *adapter.experts]}


def _assert_same_deltas(a, b, rtol):
    da, db = _deltas(a), _deltas(b)
    assert da.keys() == db.keys()
    for n in da:
        torch.testing.assert_close(da[n], db[n], rtol=rtol, atol=rtol * float(db[n].abs().max()))


@pytest.mark.parametrize(
    "model",
    [
        "tiny-gpt-oss",  # experts stored transposed with interleaved gate/up rows
        "tiny-qwen3-moe",  # [gate; up] rows, (E, out, in)
    ],
)
@pytest.mark.parametrize(
    "transform,rtol",
    [
        (lambda c: tf.pad_rank(c.adapter, 16), 0),  # zero rows/columns: bit-exact
        (lambda c: tf.rescale_alpha(c.adapter, 4.0), 0),  # power of two: bit-exact
        (lambda c: tf.reparametrise(c.adapter, 0), 1e-5),  # M·A, B·M⁻¹: fp32 rounding only
        (lambda c: tf.shared_outer(c.adapter, c.layout), 1e-6),  # rank E·r with one shared outer factor
    ],
)
def test_transforms_keep_every_delta_through_disk(model, transform, rtol, tmp_path):
    ctx = _ctx(model, "all", tmp_path)
    out = ctx.write("t", transform(ctx))
    _assert_same_deltas(ad.load_canonical(out, ctx.layout), ctx.adapter, rtol)


def test_shared_outer_really_shares_the_outer_factors(tmp_path):
    ctx = _ctx("tiny-qwen3-moe", "experts", tmp_path)
    so = tf.shared_outer(ctx.adapter, ctx.layout)
    for name, (a, b) in so.experts.items():
        shared = b if name.endswith("down_proj") else a
        assert torch.equal(shared, shared[:1].expand_as(shared)), name
        assert a.shape[1] == ctx.adapter.rank * a.shape[0]


@pytest.mark.parametrize("model", ["tiny-gpt-oss", "tiny-qwen3-moe"])
def test_gate_up_split_forms_are_one_adapter(model, tmp_path):
    """per-projection As (rank r per expert projection) == stacked rank-2r, whatever the row order of gate/up."""
    ctx = _ctx(model, "experts", tmp_path)
    split = tf.split_gate_up(ctx.adapter, ctx.layout, seed=3)
    per_expert = ctx.write("pe", split, "per_expert")
    per_proj = tf.strip_zero_rank(per_expert, tmp_path / "pp")
    assert ad.inspect_adapter(per_proj).rank == ctx.adapter.rank  # each projection keeps its own rank-r A
    for form in (per_proj, per_expert, ctx.write("3d", split, "peft3d")):
        _assert_same_deltas(ad.load_canonical(form, ctx.layout), split, 0)
    gu = next(n for n in split.experts if n.endswith("gate_up_proj"))
    a = split.experts[gu][0]
    r = ctx.adapter.rank
    assert not torch.equal(a[:, :r], a[:, r:]), "gate and up must have different A matrices"


def test_not_applicable_relations_say_why(tmp_path):
    # nemotron's experts are not gated; an attention-only adapter has no expert layouts; vLLM misreads gpt-oss's
    # per-expert gate/up (harness.doctor), so it cannot run that format, while hf converts the file and runs it
    na = {r.relation: r.note for r in mm.plan(_ctx("tiny-nemotron-h", "experts", tmp_path / "n", "hf"), ["gate_up"])[1]}
    assert "not gated" in na["gate_up"]
    na = {r.relation: r.note for r in mm.plan(_ctx("tiny-qwen3-moe", "attention", tmp_path / "q"), ["format"])[1]}
    assert "no expert LoRA" in na["format"]
    lanes, na = mm.plan(_ctx("tiny-gpt-oss", "experts", tmp_path / "g", "vllm"), ["format"])
    assert [r.relation for r in na] == ["format:per_expert"] and "vllm-per-expert-interleaved" in na[0].note
    assert [lane.name for lane in lanes] == ["format:shared_outer"]
    lanes, na = mm.plan(_ctx("tiny-gpt-oss", "experts", tmp_path / "h", "hf"), ["format"])
    assert na == [] and [lane.name for lane in lanes] == ["format:per_expert", "format:shared_outer"]
    with pytest.raises(ValueError, match="unknown relation"):
        mm.plan(_ctx("tiny-qwen3-moe", "attention", tmp_path / "x"), ["nope"])


def _run(values: list[float]) -> LogprobRun:
    return LogprobRun([PromptLogprobs(np.arange(len(values) + 1), np.asarray(values, np.float32))])


def test_judge_floor_exactness_and_nonfinite():
    base, orig = _run([-1.0, -2.0, -3.0]), _run([-1.5, -2.5, -2.0])
    lanes = [mm.Lane("a", "x"), mm.Lane("b", "x"), mm.Lane("z", "x", reference="base", exact=True), mm.Lane("n", "x")]
    runs = {
        "a": _run([-1.5, -2.5, -2.0 + 2e-6]),  # fp32-rounding-sized: ratio 2 against the 1e-6 floor
        "b": _run([-1.5, -2.5, -1.9]),  # 0.1 off: a bug
        "z": _run([-1.0, -2.0, -3.0 + 2.4e-7]),  # one ulp off where the relation is exact
        "n": _run([-1.5, float("nan"), -2.0]),
    }
    res = {r.relation: r for r in mm.judge_lanes(lanes, runs, [orig, orig], [base, base], "float32")}
    assert res["a"].verdict == "PASS" and res["a"].ratio == pytest.approx(2.0, rel=0.1)
    assert res["b"].verdict == "FAIL" and res["b"].ratio > 1e4
    assert res["b"].delta_rel == pytest.approx(0.1 / np.linalg.norm([0.5, 0.5, 1.0]), rel=1e-4)
    assert res["z"].verdict == "FAIL" and res["z"].ratio == float("inf")  # no floor for exact relations
    assert res["n"].verdict == "FAIL" and "NaN" in res["n"].note


def test_rounding_noise_bounds_inexact_lanes_and_exact_lanes_use_their_own_reference():
    base, orig = _run([-1.0, -2.0, -3.0]), _run([-1.5, -2.5, -2.0])
    lanes = [
        mm.Lane(mm.ROUNDING, "x"),
        mm.Lane("f", "x"),
        mm.Lane("far", "x"),
        mm.Lane("rows", None, reference=""),
        mm.Lane("z", "x", reference="rows", exact=True),
    ]
    runs = {
        mm.ROUNDING: _run([-1.5, -2.45, -2.0]),  # a bf16 re-rounding of the adapter moves a logprob by 0.05
        "f": _run([-1.5, -2.4, -2.0]),  # 0.1: twice the rounding noise
        "far": _run([-1.5, -1.9, -2.0]),  # 0.6: twelve times it
        "rows": _run([-1.0, -2.0, -3.001]),  # base rows of another session: other kernels
        "z": _run([-1.0, -2.0, -3.001]),
    }  # the zero-B adapter there: exactly those rows
    res = {r.relation: r for r in mm.judge_lanes(lanes, runs, [orig, orig], [base, base], "bfloat16")}
    assert res[mm.ROUNDING].verdict == "noise" and res[mm.ROUNDING].max_abs == pytest.approx(0.05, rel=1e-4)
    assert res["f"].verdict == "PASS" and res["f"].ratio == pytest.approx(2.0, rel=1e-3)
    assert "rounding noise" in res["f"].note
    assert res["far"].verdict == "FAIL" and res["far"].ratio == pytest.approx(12.0, rel=1e-3)
    assert res["z"].verdict == "PASS" and res["z"].ratio == 0 and "rows" not in res


def test_a_systematic_shift_under_the_max_bound_fails_on_k2_in_bf16():
    """Routing flips make one position's difference large (the rounding lane's max), so a lane that moves every
    position by a fifth of that passes the max test; its k2 is far above the noise's (vLLM's gpt-oss gate/up)."""
    n = 200
    base, orig = _run([-3.0] * n), _run([-2.0] * n)
    flip = [-2.0] * n
    flip[7] = -3.0  # one routing flip: max |Δ| 1, k2 1 / (2 n)
    lanes = [mm.Lane(mm.ROUNDING, "x"), mm.Lane("shifted", "x"), mm.Lane("clean", "x")]
    runs = {mm.ROUNDING: _run(flip), "shifted": _run([-2.2] * n), "clean": _run(flip[::-1])}
    res = {r.relation: r for r in mm.judge_lanes(lanes, runs, [orig, orig], [base, base], "bfloat16")}
    assert res["shifted"].ratio == pytest.approx(0.2, rel=1e-3) and res["shifted"].verdict == "FAIL"
    assert res["shifted"].k2_ratio == pytest.approx(0.04 * n, rel=1e-3) and "k2 ratio" in res["shifted"].note
    assert res["clean"].verdict == "PASS" and res["clean"].k2_ratio == pytest.approx(1.0, rel=1e-3)
    # fp32 has no k2 test: there the max is taken before router near-ties and is sharp
    fp32 = {r.relation: r for r in mm.judge_lanes(lanes, runs, [orig, orig], [base, base], "float32")}
    assert fp32["shifted"].k2_ratio is None


def test_a_mode_lane_is_bounded_by_its_own_rerun_noise_too():
    base, orig = _run([-1.0, -2.0, -3.0]), _run([-1.5, -2.5, -2.0])
    lanes = [mm.Lane("mode:tp4:lora", "x", reruns=2), mm.Lane("mode:tp4:base", None, reference="base", reruns=2)]
    runs = {
        "mode:tp4:lora": _run([-1.5, -2.4, -2.0]),
        mm.rerun_name("mode:tp4:lora", 1): _run([-1.5, -2.45, -2.0]),
        "mode:tp4:base": _run([-1.0, -2.0, -3.0]),
        mm.rerun_name("mode:tp4:base", 1): _run([-1.0, -2.0, -3.0]),
    }
    res = {r.relation: r for r in mm.judge_lanes(lanes, runs, [orig, orig], [base, base], "float32")}
    lora = res["mode:tp4:lora"]  # 0.1 off, reruns 0.05 apart: ratio 2 against its own noise, not 1e5 vs the floor
    assert lora.verdict == "PASS" and lora.ratio == pytest.approx(2.0, rel=1e-3) and "this lane's" in lora.note
    assert lora.rerun_noise == pytest.approx(0.05, rel=1e-3) and res["mode:tp4:base"].ratio == 0
    assert len(res) == 2  # reruns are not lanes of their own


def test_results_arrive_session_by_session(tmp_path):
    """A GPU job cut by its time limit keeps the sessions it finished: run_metamorphic hands each session's
    verdicts out as it ends, and together they are the report (the rounding-noise row once)."""
    spec = get_model("tiny-qwen3-moe")
    got = []
    rep = mm.run_metamorphic(
        "triton",
        spec,
        zoo_adapters(spec.name)["all"].path,
        prompt_set(spec.name)[:3],
        relations=["factors", "zero_b", "batch", "gate_up"],
        tmp=tmp_path,
        on_results=lambda version, results: got.append((version, results)),
    )
    assert len(got) >= 2 and all(v == rep.engine_version for v, _ in got)
    names = [r.relation for _, results in got for r in results]
    assert sorted(names) == sorted(r.relation for r in rep.results) and names.count(mm.ROUNDING) == 1
    assert not rep.failed, mm.format_report(rep)


def _concatenated_part_rows(self):
    """The fault: gpt-oss's interleaved gate/up rows read as [gate; up] halves."""
    return list(torch.arange(self.out_features).view(len(self.parts), -1))


def test_converter_reading_interleave_as_concatenated_fails_format(tmp_path, monkeypatch):
    """A per-expert converter copy with the gpt-oss interleave bug: its file loads fine and moves the logprobs, but
    the engine computes another adapter, and format:per_expert FAILs; the unbroken shared-outer form passes."""
    real_save = ad.save_canonical

    def faulty_save(adapter, out_dir, model_config, layout="peft3d", **kw):
        if layout != "per_expert":
            return real_save(adapter, out_dir, model_config, layout, **kw)
        with monkeypatch.context() as m:
            m.setattr(ad.ExpertParam, "part_rows", _concatenated_part_rows)
            return real_save(adapter, out_dir, model_config, layout, **kw)

    monkeypatch.setattr(rel, "save_canonical", faulty_save)
    spec = get_model("tiny-gpt-oss")
    rep = mm.run_metamorphic(
        "triton",
        spec,
        zoo_adapters(spec.name)["experts"].path,
        prompt_set(spec.name)[:4],
        relations=["format"],
        tmp=tmp_path,
    )
    bad, good = rep.get("format:per_expert"), rep.get("format:shared_outer")
    assert bad.verdict == "FAIL" and bad.ratio > 100 * mm.FACTOR and bad.delta_rel > 0.1, mm.format_report(rep)
    assert good.verdict == "PASS", mm.format_report(rep)


def test_engine_path_dropping_an_expert_fails_format(tmp_path, monkeypatch):
    """The engine's per-expert load path loses expert 0 (as an engine skipping weights it cannot map does): only
    the per-expert lane sees it, so format:per_expert FAILs and names the dropped part."""
    real_fuse = ad.canonical._fuse_per_expert

    def drop_expert_0(layout, module, projs):
        out = real_fuse(layout, module, projs)
        for _a, b in out.values():
            b[0] = 0
        return out

    monkeypatch.setattr(ad.canonical, "_fuse_per_expert", drop_expert_0)
    spec = get_model("tiny-qwen3-moe")
    rep = mm.run_metamorphic(
        "triton",
        spec,
        zoo_adapters(spec.name)["experts"].path,
        prompt_set(spec.name)[:4],
        relations=["format"],
        tmp=tmp_path,
    )
    assert rep.get("format:per_expert").verdict == "FAIL", mm.format_report(rep)
    assert rep.get("format:per_expert").ratio > 100 * mm.FACTOR
    assert rep.get("format:shared_outer").verdict == "PASS"


def test_cli_runs_relations_and_appends_csv(tmp_path, capsys):
    from lpdiff.harness.cli import main

    out = tmp_path / "m.csv"
    rc = main(
        [
            "metamorphic",
            "tiny-qwen3-moe",
            "attention",
            "--engine",
            "hf",
            "--prompt-set",
            "short",
            "--relation",
            "zero_b",
            "--relation",
            "factors",
            "--relation",
            "format",
            "--csv",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = list(csv.DictReader(out.open()))
    assert tuple(rows[0]) == mm.CSV_COLUMNS
    got = {r["relation"]: r for r in rows}
    assert got["zero_b:vs_base"]["verdict"] == "PASS" and float(got["zero_b:vs_base"]["max_abs"]) == 0
    assert got["format"]["verdict"] == "n/a" and "no expert LoRA" in got["format"]["note"]
    assert {r["engine"] for r in rows} == {"hf"} and "factors:M_A_B_Minv" in printed


def test_suite_expects_known_engine_defects_to_fail():
    """A lane listed as a known engine defect must FAIL (and does not fail the suite); once it passes, the suite
    fails so that the fix gets recorded. Other FAILs still fail it."""
    from suites.test_metamorphic import _check

    lane = "mode:mixed_moe_lora_format:lora"

    def report(*results):
        return mm.Report("vllm", "vllm 0.25.1", "gpt-oss-20b", "a16", "bfloat16", 3, list(results))

    bad, good = mm.Result(lane, "FAIL", 3.0, ratio=30.0, rerun_noise=0.1), mm.Result(lane, "PASS", 0.1, ratio=1.0)
    other = mm.Result("factors:M_A_B_Minv", "FAIL", 3.0, ratio=30.0, rerun_noise=0.1)
    _check(report(bad), arch="gpt_oss")
    with pytest.raises(AssertionError, match="no longer reproduced"):
        _check(report(good), arch="gpt_oss")
    with pytest.raises(AssertionError, match="factors"):
        _check(report(bad, other), arch="gpt_oss")
    with pytest.raises(AssertionError, match="mixed_moe"):  # on Qwen3-MoE the same lane is not a known defect
        _check(report(bad), arch="qwen3_moe")


@pytest.mark.parametrize(
    "engine,prefix",
    [("vllm", "base_model.model.model.language_model.layers."), ("sglang", "base_model.model.model.layers.")],
)
def test_relation_files_are_named_under_the_root_the_engine_reads(tmp_path, engine, prefix):
    """vLLM reads Qwen3.5 adapter names under the checkpoint's model.language_model and drops text-model names
    (vllm-qwen3.5-text-names); the relations' files must be ones it reads, with the same deltas."""
    from safetensors import safe_open

    ctx = _ctx("tiny-qwen3.5-moe", "all", tmp_path, engine=engine)
    out = ctx.write("t", tf.pad_rank(ctx.adapter, 16))
    with safe_open(str(Path(out) / ad.WEIGHTS_NAME), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(prefix) for k in keys), keys[:3]
    if engine == "vllm":  # (SGLang refuses PEFT 3D expert files for another reason: peft3d-kills-sglang)
        assert ctx.refused(out) is None
    _assert_same_deltas(ad.load_canonical(out, ctx.layout), ctx.adapter, 0)


HF_DEFAULT_MODELS = ("tiny-qwen3-moe", "tiny-gpt-oss", "tiny-qwen3.5-moe")


@pytest.mark.parametrize("model", HF_DEFAULT_MODELS)
def test_hf_sessions_run_every_referenced_lane_first(model, tmp_path):
    """hf splits lanes into sessions by PEFT signature; gate_up's per-expert forms are judged against its PEFT 3D
    form, which lands in a session first seen later. Every lane's reference must have run (its session earlier, or
    its own) when its session ends and is judged: the default relations on each gated zoo model."""
    ctx = _ctx(model, "all", tmp_path, engine="hf")
    lanes, _ = mm.plan(ctx, None)
    order = mm.sessions(ctx, lanes)
    at = {lane.name: i for i, (_, group) in enumerate(order) for lane in group}
    refs = [(lane.name, lane.reference) for lane in lanes if lane.reference in at]
    assert any(r.startswith("gate_up:") for _, r in refs) and len({k for k, _ in order}) > 2
    late = [(name, ref) for name, ref in refs if at[ref] > at[name]]
    assert not late, late


def test_hf_default_relations_run_end_to_end(tmp_path):
    """The reported command, `lpdiff metamorphic tiny-qwen3-moe all --engine hf` with its default relations
    (exit 2, `error: gate_up:stacked_2r_peft3d` before), on the fewest prompts: every relation judged, none
    failed, the gate_up forms against the PEFT 3D form."""
    spec = get_model("tiny-qwen3-moe")
    rep = mm.run_metamorphic(
        "hf", spec, zoo_adapters(spec.name)["all"].path, prompt_set(spec.name, "short")[:2], tmp=tmp_path
    )
    assert not rep.failed, mm.format_report(rep)
    gate_up = [r for r in rep.results if r.relation.startswith("gate_up:")]
    assert len(gate_up) == 2 and all(
        r.verdict == "PASS" and "vs gate_up:stacked_2r_peft3d" in r.note for r in gate_up
    ), mm.format_report(rep)
