"""Init recipe peaked/v1 on every full-size architecture, narrowed for the CPU: deterministic per seed, part of the
baseline key, selectable by argument or LPDIFF_INIT_RECIPE, decisive routers and peaked outputs where the default
recipe has neither, and the checkpoint engines load holds the same weights as the HF reference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lpdiff.harness.build.zoo_measure import bf16_ulp, forward_stats
from lpdiff.harness.spec import init_recipe as ir
from lpdiff.harness.spec.catalog import (
    FULL_CONFIGS,
    INIT_RECIPE,
    INIT_RECIPE_ENV,
    get_model,
    load_hf_model,
    resolve_init_recipe,
    text_arch,
)
from lpdiff.harness.spec.checkpoint import write_checkpoint
from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.spec.routing import topk_margin
from lpdiff.harness.types import ModelSpec
from tests.helpers.configs import narrow_full_config

PEAKED = ir.PEAKED
NAMES = list(FULL_CONFIGS)


def narrow_spec(name: str, recipe: str = PEAKED, seed: int = 0, cfg: dict | None = None) -> ModelSpec:
    cfg = cfg or narrow_full_config(name)
    return ModelSpec(
        name=name,
        arch=text_arch(cfg),
        config=cfg,
        init_seed=seed,
        init_recipe=recipe,
        num_layers=8 if name.startswith("nemotron") else 4,
    )


def prompts(n: int = 6, length: int = 40, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def measure(spec: ModelSpec) -> dict:
    """fp32 entropy / log V, router margin / bf16 spacing at the k-th score, and the share of (token, MoE layer)
    whose expert set the bf16 build of the same spec picks differently."""
    p = prompts()
    f32 = forward_stats(load_hf_model(spec, torch.float32, "cpu"), p)
    b16 = forward_stats(load_hf_model(spec, torch.bfloat16, "cpu"), p)
    ratios, flips = [], []
    for (s32, k), (s16, _) in zip(f32["routers"], b16["routers"]):
        ratios.append(topk_margin(s32, k) / bf16_ulp(s32.topk(k, -1).values[:, -1]))
        sets = [s.topk(k, -1).indices.sort(-1).values for s in (s32, s16)]
        flips.append((sets[0] != sets[1]).any(-1).float())
    ratios = torch.cat(ratios).double()
    return {
        "entropy": float(f32["entropy"].mean()) / math.log(128),
        "ratio_p1": float(ratios.quantile(0.01)),
        "flips": float(torch.cat(flips).mean()),
        "routers": f32["routers"],
    }


@pytest.mark.parametrize("name", NAMES)
def test_peaked_routers_decisive_and_outputs_peaked_where_default_is_not(name):
    default, peaked = measure(narrow_spec(name, INIT_RECIPE)), measure(narrow_spec(name))
    assert default["entropy"] > 0.9 and default["ratio_p1"] < 3  # the trap the recipe exists for
    assert peaked["entropy"] < 0.5
    assert peaked["ratio_p1"] > 40, peaked["ratio_p1"]  # the trained tiny zoo: 23-230
    assert peaked["flips"] == 0.0


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "nemotron-3-super-120b-a12b"])
def test_deterministic_per_seed(name):
    a, b, c = (load_hf_model(narrow_spec(name, seed=s), torch.bfloat16, "cpu").state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith(("gate.weight", "router.weight")))
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_recipe_is_selected_and_in_the_key(monkeypatch):
    monkeypatch.delenv(INIT_RECIPE_ENV, raising=False)
    default = get_model("qwen3-30b-a3b")
    assert default.init_recipe == INIT_RECIPE == "hf-init-bf16/v1"
    peaked = get_model("qwen3-30b-a3b", init_recipe=PEAKED)
    assert peaked.identity()["recipe"] == PEAKED and peaked.identity() != default.identity()
    monkeypatch.setenv(INIT_RECIPE_ENV, PEAKED)
    assert get_model("qwen3-30b-a3b").identity() == peaked.identity()
    assert get_model("qwen3-30b-a3b", init_recipe=INIT_RECIPE).identity() == default.identity()
    assert get_model("tiny-qwen3-moe").init_recipe is None  # checkpoint directories have no recipe
    monkeypatch.setenv(INIT_RECIPE_ENV, INIT_RECIPE)  # the environment wins over a caller's default (the GPU grid)
    assert resolve_init_recipe(default=PEAKED) == INIT_RECIPE
    monkeypatch.delenv(INIT_RECIPE_ENV)
    assert resolve_init_recipe(default=PEAKED) == PEAKED
    monkeypatch.setenv(INIT_RECIPE_ENV, "peaked/v0")
    with pytest.raises(SpecError, match=f"{INIT_RECIPE_ENV}='peaked/v0'.*hf-init-bf16/v1, peaked/v1"):
        get_model("qwen3-30b-a3b")
    with pytest.raises(SpecError, match="init recipe 'peaked/v0' is unknown"):
        load_hf_model(narrow_spec("qwen3-30b-a3b", recipe="peaked/v0"), torch.float32, "cpu")


@pytest.mark.parametrize("name", NAMES)
def test_engine_checkpoint_loads_back_with_the_reference_logits(tmp_path, name):
    """engines/checkpoint.py writes the bf16 build; transformers reading it in fp32 gives the fp32 reference's
    logits exactly (the weights are bf16-representable by recipe)."""
    from transformers import AutoModelForCausalLM

    spec = narrow_spec(name)
    out = write_checkpoint(load_hf_model(spec, torch.bfloat16, "cpu"), spec, tmp_path / "ckpt")
    ref = load_hf_model(spec, torch.float32, "cpu")
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor(prompts(2, 24))
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids, use_cache=False).logits, back(input_ids=ids, use_cache=False).logits)
    built = json.loads((out / "lpdiff_init.json").read_text())
    assert built["recipe"] == PEAKED and built["beta"] > 0 and max(built["leakage"]) < 0.05


def test_checkpoint_refuses_a_model_of_another_recipe(tmp_path):
    spec = narrow_spec("gpt-oss-20b")
    model = load_hf_model(narrow_spec("gpt-oss-20b", INIT_RECIPE), torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="built with init recipe hf-init-bf16/v1 seed 0, the spec says peaked/v1"):
        write_checkpoint(model, spec, tmp_path / "ckpt")


def test_grouped_routing_picks_inside_the_groups():
    """n_group 2 / topk_group 1 (the catalog's Nemotrons use one group): every token's experts share a group and
    the group choice is as decisive as the expert choice."""
    cfg = narrow_full_config("nemotron-3-nano-30b-a3b")
    cfg.update(n_group=2, topk_group=1)
    r = measure(narrow_spec("nemotron-3-nano-30b-a3b", cfg=cfg))
    assert r["ratio_p1"] > 40 and r["flips"] == 0.0
    for scores, k in r["routers"]:
        groups = scores.topk(k, -1).indices // (scores.shape[-1] // 2)
        assert (groups == groups[:, :1]).all()


def test_an_unprojected_residual_writer_is_caught(monkeypatch):
    """The recipe's own check: if a weight that writes the residual stream is missed, the code no longer reaches
    the routers intact and the build fails naming the layer, instead of routing on noise."""
    real = ir.residual_writers
    monkeypatch.setattr(
        ir, "residual_writers", lambda model, moe: [w for w in real(model, moe) if "o_proj" not in w[0]]
    )
    with pytest.raises(RuntimeError, match="leakage: a weight that writes the residual stream is not projected"):
        load_hf_model(narrow_spec("qwen3-30b-a3b"), torch.float32, "cpu")
