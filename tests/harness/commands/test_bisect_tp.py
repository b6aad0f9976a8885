"""lpdiff bisect at TP 2 (gloo ranks on the CPU), on mixed batches and on user adapters: it names the layer, module
and adapter of defects it is not told about — the tests' own (tests/helpers/defect_hook), in no bug zoo — and
nothing on the clean runtime. The defects reach the spawned TP workers through the hook's sitecustomize."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from lpdiff.harness.cli import main
from lpdiff.harness.commands import bisect as bs
from lpdiff.harness.commands.run import default_tps
from tests.helpers.paths import HELPERS

HOOK = HELPERS / "defect_hook"
ZOO = Path(bs.__file__).resolve().parents[1] / "zoo_adapters"
MODELS = ("tiny-qwen3-moe", "tiny-gpt-oss")
needs_tp2 = pytest.mark.skipif(
    2 not in default_tps("triton"), reason="the triton runtime cannot run TP 2 here (one GPU: a rank per GPU)"
)


def _with_defect(monkeypatch, name: str) -> None:
    """In this process (rank 0) and, through the environment, in every TP worker it spawns."""
    monkeypatch.syspath_prepend(str(HOOK))
    import lpdiff_test_defects as defects

    defects.install([name], monkeypatch.setattr)
    for k, v in defects.env([name]).items():
        monkeypatch.setenv(k, v)


def _where(found: bs.Finding | None) -> tuple | None:
    return None if found is None else (found.adapter, found.layer, found.module)


@needs_tp2
@pytest.mark.parametrize("model", MODELS)
def test_clean_runtime_at_tp2_in_a_mixed_batch_names_nothing(model):
    """Base rows, an experts adapter (rank 4) and an attention adapter (rank 8) in one batch, the runtime at TP 2:
    every module of every row within 10x the HF floor, which stays fp32 rounding."""
    res = bs.bisect(model, ["experts", "attention"], num_prompts=3, tp=2)
    assert res.choices == [None, "experts", "attention"]
    assert res.finding is None, res.table()
    assert {c for c, _, _ in res.errors} == {None, "experts", "attention"}
    assert max(res.floors.values()) < 1e-5, res.floors


TP_CASES = [("tp_expert_lora_twice", m, ("experts", 1, "expert_lora")) for m in MODELS] + [
    ("tp_partial_twice", "tiny-qwen3-moe", ("experts", 0, "attention"))
]


@needs_tp2
@pytest.mark.parametrize("defect, model, where", TP_CASES, ids=[f"{d}-{m}" for d, m, _ in TP_CASES])
def test_names_a_tp_only_defect(defect, model, where, monkeypatch):
    """tp_expert_lora_twice: rank 1 counts its partial of layer 1's expert LoRA delta twice -> layer 1 expert_lora.
    tp_partial_twice: rank 1 counts every row-parallel partial twice, in every layer -> layer 0 attention (a floor
    taken from the engine under test would be this defect itself). At TP 1 (no rank 1) the same runtime names
    nothing, so the finding is the defect's, not the TP size's."""
    _with_defect(monkeypatch, defect)
    res = bs.bisect(model, ["experts"], num_prompts=3, tp=2)
    assert _where(res.finding) == where, res.table()
    assert res.finding.ratio > 10 * bs.FACTOR
    assert bs.bisect(model, ["experts"], num_prompts=3, tp=1).finding is None


def test_names_the_adapter_of_a_mixed_batch_defect_from_a_user_directory(tmp_path, monkeypatch, capsys):
    """A PEFT directory of the user's (a copy of the zoo's attention adapter) last in a mixed batch with the zoo's
    experts adapter and base rows; the runtime misreads that slot's layer-1 o_proj LoRA. The CLI names it by its
    folder name with layer 1 attention_lora, exit 1; the same batch without the defect names nothing, exit 0."""
    model = "tiny-qwen3-moe"
    mine = tmp_path / "mine"
    shutil.copytree(ZOO / model / "attention", mine)
    args = ["bisect", model, "--adapter", "experts", "--adapter", str(mine), "--num-prompts", "3", "--tp", "1"]
    assert main(args) == 0
    assert "every module within" in capsys.readouterr().out
    _with_defect(monkeypatch, "last_slot_o_misread")
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "[base, experts, mine]" in out and "first above noise: layer 1 attention_lora of mine" in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["mine", "0"], ["experts", "1"])]
    assert len(rows) == 2 and not any(cell.endswith("*") for row in rows for cell in row), out


def test_cli_bisect_bad_input_exits_2(tmp_path, capsys):
    """A folder that is no PEFT adapter, an impossible TP size: one clear error each, exit 2."""
    assert main(["bisect", "tiny-qwen3-moe", "--adapter", str(tmp_path)]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
    assert main(["bisect", "tiny-qwen3-moe", "--tp", "3"]) == 2
    assert "--tp 3: the triton runtime runs TP 1, 2, 4, 8" in capsys.readouterr().err


@needs_tp2
@pytest.mark.slow  # a failing run, then plain bisect over every zoo adapter at TP 1 and 2: 84-200 s
def test_a_run_fail_names_the_bisect_command_and_plain_bisect_localises_it(tmp_path, monkeypatch, capsys):
    """A defect only TP 2 shows (rank 1 counts its layer-1 expert LoRA partial twice): the run's TP 2 verdict names
    the bisect command for its model, adapters and TP (`lpdiff bisect tiny-qwen3-moe --adapter all --tp 2`, printed
    below the table too), and plain `lpdiff bisect tiny-qwen3-moe` covers what a plain run covers (every zoo adapter
    in one mixed batch with base rows, TP 1 and 2; one prompt per row kind keeps the test short): it names layer 1
    expert_lora at TP 2, exit 1. Before, bisect's defaults (the experts adapter alone, TP 1) found nothing, exit 0."""
    from lpdiff.harness.pipeline.verdict import from_json

    model = "tiny-qwen3-moe"
    _with_defect(monkeypatch, "tp_expert_lora_twice")
    out_json = tmp_path / "v.json"
    assert (
        main(["run", "--model", model, "--engine", "triton", "--tp", "2", "--adapter", "all", "--json", str(out_json)])
        == 1
    )
    bad = [v for v in from_json(out_json.read_text()) if not v.passed]
    assert [v.adapter for v in bad] == ["all"], capsys.readouterr().out
    assert bad[0].next_step == f"lpdiff bisect {model} --adapter all --tp 2"
    assert f"next step: lpdiff bisect {model} --adapter all --tp 2" in capsys.readouterr().out
    assert main(shlex.split(f"bisect {model} --num-prompts 1")) == 1  # the default batch and TP sizes, 1 prompt each
    out = capsys.readouterr().out
    assert "tp=1\n" in out and "tp=2\n" in out, out
    zoo = sorted(p.name for p in (ZOO / model).iterdir())
    assert f"[base, {', '.join(zoo)}] tp=1 the runtime: every module within" in out, out
    assert f"[base, {', '.join(zoo)}] tp=2 the runtime: first above noise: layer 1 expert_lora of all" in out, out
