"""benchmarks/init_recipe.py on CPU, on every catalog architecture narrowed (tests/helpers/configs.py): one row per
model and recipe with every column, and the numbers tell the recipes apart the way the GPU run should."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import init_recipe as bench
from lpdiff.harness.spec.catalog import FULL_CONFIGS, INIT_RECIPE, INIT_RECIPES, text_arch
from lpdiff.harness.types import ModelSpec
from tests.helpers.configs import narrow_full_config


def narrow_specs() -> list[ModelSpec]:
    return [
        ModelSpec(
            name=n,
            arch=text_arch(narrow_full_config(n)),
            config=narrow_full_config(n),
            init_seed=0,
            init_recipe=INIT_RECIPE,
            num_layers=bench.default_layers(n),
        )
        for n in FULL_CONFIGS
    ]


def test_rows_for_every_model_and_recipe(tmp_path):
    out = tmp_path / "init_recipe.csv"
    lines = []
    rows = bench.run(narrow_specs(), INIT_RECIPES, "cpu", n_prompts=4, length=32, out=out, log=lines.append)
    assert [(r["model"], r["recipe"]) for r in rows] == [(n, r) for n in FULL_CONFIGS for r in INIT_RECIPES]
    with open(out) as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) and list(written[0]) == list(bench.COLUMNS)
    assert all(v != "" for row in written for v in row.values())
    assert sum(line.endswith("s") and ": " in line and " x" not in line for line in lines) == len(FULL_CONFIGS)
    for r in rows:
        assert r["build_s"] >= 0 and r["margin_p1"] <= r["margin_p10"] <= r["margin_p50"]
        if r["recipe"] == INIT_RECIPE:
            assert r["entropy_over_logv"] > 0.9 and r["ratio_p1"] < 3, r
        else:
            assert r["entropy_over_logv"] < 0.5 and r["ratio_p1"] > 40 and r["flip_share"] == 0.0, r
            assert r["adapted_ratio_p1"] > 40 and r["adapted_route_change"] == 0.0, r
            assert 0 < r["bf16_k2"] < 1e-2


def test_merged_adapter_moves_every_decoder_matrix_but_routers():
    spec = narrow_specs()[1]  # gpt-oss: fused transposed experts, router with bias
    from lpdiff.harness.spec.catalog import load_hf_model

    model = load_hf_model(spec, torch.float32, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert bench.merge_random_adapter(model) > 0
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert not any("router" in k for k in changed)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.down_proj"} <= changed
    w, d = before["model.layers.0.mlp.experts.down_proj"], after["model.layers.0.mlp.experts.down_proj"]
    rel = float((d - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())
    assert rel == pytest.approx(bench.ADAPTER_SCALE, rel=0.3)


def test_cuda_without_a_gpu_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main(["--models", "qwen3-30b-a3b", "--device", "cuda"])
    assert e.value.code == 2
