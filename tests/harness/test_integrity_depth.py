"""Issue 44 item 7: the hint a depth-cut run prints (``lpdiff regen --num-layers 2``) can be followed: regen at depth
2 with the zoo's default adapters (the per-expert one included, whose conversion refused the cut-off layers' entries,
exit 2), then ``run --num-layers 2`` against those baselines passes, on the HF reference and on triton. Real CLI,
real engines, real adapters."""

from __future__ import annotations

import numpy as np
import pytest

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.cli import main
from lpdiff.harness.spec.adapters.depth import cut_adapter, deeper_entries
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.resolve import zoo_adapters

MODEL = "tiny-qwen3-moe"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LPDIFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _lpdiff(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_regen_then_run_at_a_cut_depth_with_the_default_adapters(tmp_path, cache, capsys):
    store = tmp_path / "B"
    rc, out, err = _lpdiff(capsys, "regen", "--model", MODEL, "--num-layers", 2, "--engine", "hf", "--baselines", store)
    assert rc == 0, err
    assert "experts_per_expert" in out and "FAIL" not in out
    for engine in ("hf", "triton"):
        rc, out, err = _lpdiff(
            capsys,
            "run",
            "--model",
            MODEL,
            "--num-layers",
            2,
            "--engine",
            engine,
            "--tp",
            1,
            "--adapter",
            "experts_per_expert",
            "--baselines",
            store,
        )
        assert rc == 0 and "FAIL" not in out and "experts_per_expert" in out, (engine, err)


def test_hf_engine_takes_an_uncut_per_expert_adapter_on_a_cut_model(cache):
    spec = get_model(MODEL, num_layers=2)
    full = zoo_adapters(MODEL)["experts_per_expert"]
    assert deeper_entries(full.path, 2)  # the zoo adapter covers all four layers
    cut = cut_adapter(full, 2, cache)
    assert cut.path != full.path and not deeper_entries(cut.path, 2) and cut_adapter(cut, 2, cache) == cut
    prompts = [[5, 17, 300, 42, 9, 801, 3, 77]]
    runs = []
    for a in (full, cut):
        with open_engine("hf", EngineConfig(model=spec, adapters={a.name: a}, dtype="float32", device="cpu")) as e:
            runs.append(e.prompt_logprobs(prompts, a.name)[0].logprobs)
    assert np.array_equal(*runs)
