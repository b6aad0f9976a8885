"""LoRA neutrality (relations._neutral, issue 42): base rows of a LoRA-enabled engine, alone and beside a row of every
adapter it holds, equal a LoRA-disabled engine's (a session started with no adapters) bit for bit on deterministic
engines. CPU, tiny zoo: hf and triton pass exactly; a triton runtime whose base rows take a LoRA slot FAILs."""

from __future__ import annotations

import pytest

from lpdiff.harness.commands import metamorphic as mm
from lpdiff.harness.commands import relations as rel
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.spec.resolve import zoo_adapters

MODEL = "tiny-qwen3-moe"


def _neutral(engine: str, tmp_path, **kw) -> tuple[mm.Report, list[str]]:
    logs: list[str] = []
    rep = mm.run_metamorphic(
        engine,
        get_model(MODEL),
        zoo_adapters(MODEL)["all"].path,
        prompt_set(MODEL)[:3],
        adapter_name="all",
        relations=["neutral"],
        tmp=tmp_path,
        log=logs.append,
        **kw,
    )
    print("\n" + mm.format_report(rep))
    return rep, logs


def test_neutral_is_a_default_relation_with_an_exact_lane_per_arrangement():
    assert "neutral" in rel.RELATIONS and "among_adapters" in rel.ARRANGEMENTS


def test_among_adapters_puts_each_base_row_beside_every_adapter_in_rotating_places():
    lane = rel.Lane("neutral:base_among_adapters", None, arrangement="among_adapters")
    ((idx, who),) = mm._arrange(lane, 3, 0, ["orig", "other", "neighbour:x"])
    assert idx == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(3):
        rows = who[4 * i : 4 * i + 4]
        assert sorted(rows, key=str) == sorted(["lane", "orig", "other", "neighbour:x"], key=str)
        assert rows.index("lane") == (-i) % 4  # the base row moves through the batch


@pytest.mark.parametrize("engine", ["hf", "triton"])
def test_base_rows_are_bit_equal_with_and_without_lora(engine, tmp_path):
    """The LoRA-disabled session holds no adapter (its engine starts without LoRA); the LoRA-enabled one holds the
    original, the neighbour and one more adapter (Context.neighbours), and its base rows equal it exactly."""
    extra = {"attention": zoo_adapters(MODEL)["attention"].path} if engine == "triton" else {}
    rep, logs = _neutral(engine, tmp_path, neighbours=extra)
    got = {r.relation: r for r in rep.results}
    assert set(got) == {"neutral:base_alone", "neutral:base_among_adapters"}, got
    for r in got.values():
        assert r.verdict == "PASS" and r.max_abs == 0.0 and r.rerun_noise == 0.0, r
    off = next(s for s in logs if s.startswith("session neutral:lora_off") and "lane(s)" in s)
    on = next(s for s in logs if s.startswith("session neutral:lora_on") and "lane(s)" in s)
    assert "0 adapter(s)" in off and f"{2 + len(extra)} adapter(s)" in on, (off, on)


def test_a_lora_slot_on_base_rows_fails_neutrality(monkeypatch, tmp_path):
    """Planted in-process (the triton engine at TP 1 runs in this process): base rows (no adapter, slot -1) indexed
    as Python's -1, i.e. into the last slot, so the last adapter's LoRA lands on every base row of a LoRA-enabled
    engine; the LoRA-disabled engine has no slots. Not a bug-zoo fault (kernels/faults.py): every zoo fault is also
    judged by bisect layer by layer, and this one needs no kernel or layer to show."""
    from lpdiff.engines.triton.runtime import Runtime

    real = Runtime.slot

    def last_slot(self, name):
        return len(self.lora.names) - 1 if name is None and self.lora is not None else real(self, name)

    monkeypatch.setattr(Runtime, "slot", last_slot)
    rep, _ = _neutral("triton", tmp_path)
    got = {r.relation: r for r in rep.results}
    for lane in ("neutral:base_alone", "neutral:base_among_adapters"):
        assert got[lane].verdict == "FAIL" and got[lane].max_abs > 1e-3 and got[lane].ratio == float("inf"), got


def test_vllm_on_cpu_reports_moe_neutrality_not_applicable(tmp_path):
    """vLLM runs MoE-LoRA on GPUs only (Capabilities.moe_lora_cpu): on a CPU the relation says so instead of
    starting an engine that would die (the dense model's neutrality is in tests/engines/vllm/test_neutrality.py)."""
    from lpdiff.harness.spec.adapters import ModelLayout, load_canonical
    from lpdiff.harness.spec.catalog import hf_config

    spec = get_model(MODEL)
    hf = hf_config(spec)
    layout = ModelLayout.from_config(hf)
    path = zoo_adapters(MODEL)["all"].path
    ctx = rel.Context("vllm", spec, hf, layout, load_canonical(path, layout), path, tmp_path)
    lanes, na = mm.plan(ctx, ["neutral"])
    assert not lanes and na[0].verdict == "n/a" and "only on a GPU" in na[0].note
