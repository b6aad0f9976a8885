"""The tiny zoo: committed weights are the ones recorded, saved in the Hub's layout, and behave like trained models
(peaked next-token distributions, decisive routers) on the committed prompt sets."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors import safe_open

from lpdiff.harness.spec.catalog import ZOO, ZOO_DIR
from lpdiff.harness.spec.prompts import SETS, prompt_set
from lpdiff.harness.types import prompts_hash

# sha256 of each committed model.safetensors: a rebuild (python -m lpdiff.harness.build.zoo build) changes these on
# purpose only; update them together with docs/zoo.md and regenerate the baselines.
WEIGHTS_SHA256 = {
    "tiny-qwen3-moe": "1550d4bd7f88354bcb4f84ee24bbd14b941a32b8df69f723b90057847f37815f",
    "tiny-gpt-oss": "2f2b15c6fb10b31cb4ed75539e68c71e4056437d3bc47c6e94dca59d4e7cc8a2",
    "tiny-qwen3.5-moe": "e3d7b7d83f22a8dbd3c1afbadc9c1cad0fd8205e81303a8c6c05390e6d9d3748",
    "tiny-nemotron-h": "cd8a9dc8055dcc04a2b3f49b4183e48ef266dafc143c23098da7b325eaf55701",
    "tiny-qwen3-dense": "eb13e84ce1a4bdedfdc49d294567d1320ff57dee643ec8cd38083d09bd511d4b",
}

# The prompt sets' token ids (tokenizer + held-out text are committed; a tokenizers upgrade must not move them).
PROMPTS_SHA256 = {"default": "51505cdc27c6506dd17235dfb8f31cd37bdfe029872ef30bad623b1ca2203b4a"}

# Properties the recipe must deliver on the default prompt set, with room below what was measured
# (docs/zoo.md): a model that regressed to random-init behaviour fails each of them.
MAX_ENTROPY_FRACTION = 0.45  # mean next-token entropy / log V
MIN_MARGIN_OVER_ULP_P1 = 8.0  # 1st percentile of (top-k routing margin / bf16 spacing at the k-th score)
MAX_FLIP_RATE = 0.01  # share of (token, MoE layer) whose expert set differs between fp32 and bf16
MIN_EXPERT_LOAD = 0.1  # least-used expert's share of assignments relative to uniform


def test_weights_match_recorded_sha256():
    for name in ZOO:
        digest = hashlib.sha256((ZOO_DIR / name / "model.safetensors").read_bytes()).hexdigest()
        assert digest == WEIGHTS_SHA256[name], f"{name} weights changed (rebuilt?): {digest}"


def _keys(name: str) -> dict[str, tuple[int, ...]]:
    with safe_open(ZOO_DIR / name / "model.safetensors", "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def test_hub_layout_on_disk():
    q3 = _keys("tiny-qwen3-moe")  # per-expert on disk, fused only in memory
    assert q3["model.layers.0.mlp.experts.7.gate_proj.weight"] == (40, 128)
    assert not any(k.endswith("experts.gate_up_proj") for k in q3)
    q35 = _keys("tiny-qwen3.5-moe")
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in q35
    assert "model.layers.0.mlp.shared_expert_gate.weight" in q35
    oss = _keys("tiny-gpt-oss")  # fused and transposed: (E, H, 2I), gate/up interleaved along the last axis
    assert oss["model.layers.0.mlp.experts.gate_up_proj"] == (8, 128, 80)
    assert oss["model.layers.0.mlp.experts.down_proj"] == (8, 40, 128)
    assert "model.layers.0.self_attn.sinks" in oss
    nem = _keys("tiny-nemotron-h")  # under backbone., per-expert, non-gated
    assert nem["backbone.layers.1.mixer.experts.0.up_proj.weight"] == (48, 128)
    assert "backbone.layers.1.mixer.gate.e_score_correction_bias" in nem
    assert not any("gate_proj" in k for k in nem)
    for name in ZOO:
        cfg = json.loads((ZOO_DIR / name / "config.json").read_text())
        assert cfg["vocab_size"] == 1024 and cfg["hidden_size"] <= 256 and not cfg["tie_word_embeddings"]
        assert (ZOO_DIR / name / "model.safetensors").stat().st_size < 4.5e6


def test_tokenizer_loads_and_round_trips():
    from transformers import AutoTokenizer

    from lpdiff.harness.build.zoo_data import heldout_docs

    tok = AutoTokenizer.from_pretrained(ZOO_DIR / "tiny-qwen3-dense")
    text = heldout_docs()["textwrap.py"][:2000]
    ids = tok(text)["input_ids"]
    assert len(tok) == 1024 and tok.eos_token_id == 0 and max(ids) < 1024
    assert tok.decode(ids) == text


def test_prompt_sets_deterministic_and_ragged():
    for name in SETS:
        a, b = prompt_set("tiny-qwen3-moe", name), prompt_set("tiny-gpt-oss", name)
        assert a == b and all(len(p) == n for p, n in zip(a, SETS[name].lengths))
        assert all(0 <= t < 1024 for p in a for t in p)
    default = prompt_set("tiny-qwen3-moe")
    assert prompts_hash(default) == PROMPTS_SHA256["default"]
    assert len(default) == 8 and len({len(p) for p in default}) == 8 and min(map(len, default)) >= 24
    assert max(map(len, default)) <= 96
    assert [len(p) for p in prompt_set("qwen3-30b-a3b", "long")] == list(SETS["long"].lengths)
    with pytest.raises(KeyError, match="default"):
        prompt_set("tiny-qwen3-moe", "nope")
    with pytest.raises(KeyError, match="tiny-qwen3-moe"):
        prompt_set("nope", "default")


@pytest.fixture(scope="module")
def measured():
    from lpdiff.harness.build.zoo_measure import measure

    torch.manual_seed(0)
    return {name: measure(name) for name in ZOO}


@pytest.mark.parametrize("name", list(ZOO))
def test_trained_like(measured, name):
    m = measured[name]
    assert m["positions"] == sum(len(p) - 1 for p in prompt_set(name))
    assert m["entropy_mean"] < MAX_ENTROPY_FRACTION * math.log(1024), m["entropy_mean"]
    assert m["bf16_max_abs"] < 1.0 and m["bf16_k2"] < 1e-3
    if "margin" in m:  # MoE models
        assert m["margin_over_bf16_ulp"]["p1"] > MIN_MARGIN_OVER_ULP_P1, m["margin_over_bf16_ulp"]
        assert m["routing_flip_rate"] <= MAX_FLIP_RATE
        assert m["expert_load_min"] > MIN_EXPERT_LOAD
