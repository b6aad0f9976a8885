"""The LoRA neutrality relation's mixed-batch lane is judged against the batch the engine really ran its base rows in
(relations._neutral, Capabilities.mixed_batches; issues 42 and 45): the same batch row for row without adapters
(``neutral:lora_off_among``) where one forward runs every row, the base rows alone where the engine groups rows by
adapter (HF+PEFT). Either reference on the other kind of engine is a false FAIL about batch size, not LoRA: a
row-count stand-in shows both directions on any machine, and the real engines pass on the tiny zoo with their
batches split at a 200-token step (there the other reference FAILs each of them, 1 torch thread, MKL 2024.2)"""

from __future__ import annotations

import dataclasses

import pytest

from lpdiff.engines.base import capabilities
from lpdiff.engines.registry import ENGINES
from lpdiff.harness.commands import metamorphic as mm
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.spec.resolve import zoo_adapters
from tests.helpers import row_count_engine as stand_in

MODEL = "tiny-qwen3-moe"
AMONG = "neutral:base_among_adapters"


def _neutral(engine: str, model: str, tmp_path, n: int, options: dict, neighbours: tuple[str, ...]) -> dict:
    zoo = zoo_adapters(model)
    rep = mm.run_metamorphic(
        engine,
        get_model(model),
        zoo["all"].path,
        prompt_set(model)[:n],
        adapter_name="all",
        relations=["neutral"],
        options=options,
        tmp=tmp_path,
        neighbours={name: zoo[name].path for name in neighbours},
    )
    print("\n" + mm.format_report(rep))
    return {r.relation: r for r in rep.results}


def test_engines_declare_whether_one_forward_mixes_adapters():
    """HF+PEFT sets one adapter per forward (engines/hf.py groups a call's rows by adapter); the triton runtime,
    vLLM and SGLang run a call's rows, any adapter or none, in one batch."""
    assert not capabilities("hf").mixed_batches
    assert all(capabilities(e).mixed_batches for e in ("triton", "vllm", "sglang"))


@pytest.mark.parametrize("groups", [False, True], ids=["one_forward", "grouped"])
@pytest.mark.parametrize("declared", [True, False], ids=["declares_mixed", "declares_grouped"])
def test_reference_batch_follows_mixed_batches(declared, groups, monkeypatch, tmp_path):
    """A stand-in whose rows move by 2^-20 per row of their forward: neutral PASSes bit for bit when its capability
    says how it batches, and FAILs base_among_adapters (only) when the capability says otherwise."""
    monkeypatch.setitem(ENGINES, stand_in.NAME, "tests.helpers.row_count_engine:RowCountEngine")
    monkeypatch.setattr(stand_in, "CAPABILITIES", dataclasses.replace(stand_in.CAPABILITIES, mixed_batches=declared))
    monkeypatch.setattr(stand_in, "CALLS", [])
    got = _neutral(stand_in.NAME, MODEL, tmp_path, 3, {"groups": groups}, ("attention",))
    assert set(got) == {"neutral:base_alone", AMONG}, got
    assert got["neutral:base_alone"].verdict == "PASS" and got["neutral:base_alone"].max_abs == 0.0
    among = got[AMONG]
    assert among.note == ("vs neutral:lora_off_among" if declared else "vs neutral:lora_off"), among
    if declared != groups:  # the capability tells the truth
        assert among.verdict == "PASS" and among.max_abs == 0.0 and among.rerun_noise == 0.0, among
    else:  # 3 prompts x 4 rows (the base row, orig, other, attention) against 3 rows: 9 rows' worth of 2^-20
        assert among.verdict == "FAIL" and among.max_abs == pytest.approx(9 * stand_in.ROW_STEP, rel=1e-3), among


def test_among_base_is_the_mixed_batch_row_for_row(monkeypatch, tmp_path):
    """The LoRA-disabled session runs the LoRA-enabled session's mixed call with the same prompts in the same rows,
    every row without adapter; the mixed call puts each base row beside one row of every adapter it holds."""
    monkeypatch.setitem(ENGINES, stand_in.NAME, "tests.helpers.row_count_engine:RowCountEngine")
    monkeypatch.setattr(stand_in, "CALLS", [])
    _neutral(stand_in.NAME, MODEL, tmp_path, 3, {}, ("attention", "experts"))
    held = ["orig", "other", "neighbour:attention", "neighbour:experts"]
    mixed = [c for c in stand_in.CALLS if any(c[1]) and not all(c[1])]
    reference = [c for c in stand_in.CALLS if len(c[0]) > 3 and not any(c[1])]
    assert len(mixed) == 2 and len(reference) == 1, [(len(p), a) for p, a in stand_in.CALLS]  # 2 reruns, 1 reference
    assert mixed[0] == mixed[1] and mixed[0][0] == reference[0][0] and len(reference[0][0]) == 3 * (1 + len(held))
    for i in range(3):
        assert sorted(mixed[0][1][5 * i : 5 * i + 5], key=str) == sorted([None, *held], key=str)


# against the other reference: the triton runtime's base rows in the 20-row mixed batch differ from a 4-row LoRA-off
# batch by 1.9e-6 / 1.4e-6 / 9.5e-7, HF's 4-row base group from a 20-row LoRA-off batch by 2.9e-6 / 2.9e-6 / 1.9e-6
REAL = [(e, m) for e in ("triton", "hf") for m in ("tiny-nemotron-h", "tiny-qwen3.5-moe", "tiny-qwen3-moe")]


@pytest.mark.parametrize("engine,model", REAL)
def test_real_engines_base_rows_equal_the_batch_they_ran_without_lora(engine, model, tmp_path):
    """4 prompts, the LoRA-enabled session holding the original, the neighbour and 'attention' (5 rows per prompt in
    the mixed batch), batches split at 200 padded tokens (the step boundaries long prompts cross): every lane
    bit-equal against the reference its engine's batching calls for."""
    got = _neutral(engine, model, tmp_path, 4, {"max_batch_tokens": 200}, ("attention",))
    assert set(got) == {"neutral:base_alone", AMONG}, got
    for r in got.values():
        assert r.verdict == "PASS" and r.max_abs == 0.0 and r.rerun_noise == 0.0, r
    among_ref = "neutral:lora_off_among" if capabilities(engine).mixed_batches else "neutral:lora_off"
    assert got[AMONG].note == f"vs {among_ref}", got[AMONG]
