"""The command tree's faces (harness/cli_*.py): what each builds from its options, before any engine runs."""

import click
import pytest

from lpdiff.engines import DEFAULT_ENGINE, ENGINES, REFERENCE_ENGINE
from lpdiff.harness.cli import main
from lpdiff.harness.cli_adapters import _pattern_option
from lpdiff.harness.cli_common import ENGINE
from lpdiff.harness.cli_engines import check, compare, metamorphic
from lpdiff.harness.cli_run import _request, regen, run
from lpdiff.harness.cli_store import baselines


def _params(command: click.Command, argv: list[str]) -> dict:
    return command.make_context(command.name, argv).params


def test_run_options_become_one_request():
    kw = _params(
        run,
        ["--model", "tiny-qwen3-moe", "--tp", "2", "--tp", "1", "--adapter", "attention", "--option", 'impl="torch"'],
    )
    r = _request(False, kw)
    assert (r.regen, r.models, r.tps, r.adapters) == (False, ("tiny-qwen3-moe",), (2, 1), ("attention",))
    assert r.options == {"impl": "torch"} and r.prompts is None and r.engine is None  # plan() picks DEFAULT_ENGINE
    assert r.reference == REFERENCE_ENGINE and r.prompt_set == "default" and r.top_k == 8
    assert _request(True, _params(regen, [])).regen
    with pytest.raises(click.UsageError, match="need --prompts"):
        _request(False, _params(run, ["--prompts-count", "3"]))


def test_every_engine_option_offers_the_registry():
    faces = {"run": run, "regen": regen, "compare": compare, "check": check, "metamorphic": metamorphic}
    engine_params = [p for c in faces.values() for p in c.params if isinstance(p.type, type(ENGINE))]
    assert len(engine_params) >= 8  # --engine, --reference, --against of each face
    assert all(list(p.type.choices) == list(ENGINES) for p in engine_params)
    assert DEFAULT_ENGINE in ENGINES and REFERENCE_ENGINE in ENGINES
    # run and check share the decode options
    for c in (run, check):
        assert {"decode", "sampling", "seed"} <= {p.name for p in c.params}


def test_an_unknown_engine_is_one_line_naming_the_known_ones(capsys):
    assert main(["check", "--engine", "nope", "--model", "tiny-qwen3-moe"]) == 2
    err = capsys.readouterr().err
    assert "unknown engine 'nope'; known engines: " + ", ".join(ENGINES) in err and "Traceback" not in err


def test_rank_patterns_parse_and_refuse_a_missing_value():
    assert _pattern_option("--rank-pattern", "q_proj=4,lm_head=16", int) == {"q_proj": 4, "lm_head": 16}
    with pytest.raises(click.BadParameter, match="KEY=R"):
        _pattern_option("--rank-pattern", "q_proj", int)


def test_baselines_ls_of_an_empty_store(tmp_path, capsys):
    assert baselines.main(["ls", "--baselines", str(tmp_path)], standalone_mode=False) == 0
    assert f"0 file(s) in {tmp_path}" in capsys.readouterr().err
