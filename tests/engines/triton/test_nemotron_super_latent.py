"""Nemotron-3-Super's latent MoE projections with LoRA in the triton runtime against HF+PEFT, fp32 on CPU: the tiny
Super (tests/helpers/nemotron_tiny.py: the catalog's Super narrowed in width, its first 8 layers MEMEMEM*: three
latent MoE layers, 2 mamba groups; SSD chunks of 16 tokens instead of 128, so that short prompts cross them) with
adapters the generator writes for the "latent" group (fc1_latent_proj hidden -> latent, fc2_latent_proj latent ->
hidden in every MoE layer), alone and beside the routed experts, and one on the mixers; several adapters and base
rows in one packed batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.types import AdapterSpec, ModelSpec
from tests.helpers.nemotron_tiny import tiny_super

TOL = 1e-4
LENS = [9, 40, 4, 23, 17]  # 40 crosses two 16-token SSD chunks
MIXED = ["latent", None, "moe", "mixers", None]


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def super_tiny(tmp_path_factory):
    from lpdiff.harness.spec.adapters import generate_adapter, inspect_adapter

    root = tmp_path_factory.mktemp("nemotron_super")
    model, kw = tiny_super()
    assert model.config.chunk_size < max(LENS) and model.config.moe_latent_size < model.config.hidden_size
    model.save_pretrained(root / "model")
    adapters = {
        "latent": generate_adapter(model, root / "latent", groups=("latent",), rank=8, seed=1),
        "moe": generate_adapter(model, root / "moe", groups=("latent", "experts"), rank=4, seed=2, layout="per_expert"),
        "mixers": generate_adapter(model, root / "mixers", groups=("mamba", "attention", "shared_expert"), rank=6),
    }
    latent = inspect_adapter(adapters["latent"].path)
    assert latent.groups == ["latent"]
    moe_layers = [i for i, layer in enumerate(model.model.layers) if layer.block_type == "moe"]
    assert len(moe_layers) == 3 and all(
        any(f"layers.{i}.mixer.{p}" in m for m in latent.modules())
        for i in moe_layers
        for p in ("fc1_latent_proj", "fc2_latent_proj")
    )
    spec = ModelSpec(name="tiny-nemotron-super", arch="nemotron_h", path=str(root / "model"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, kw["vocab_size"], (n,), generator=g).tolist() for n in LENS]
    return spec, {n: AdapterSpec(n, a.path) for n, a in adapters.items()}, prompts


def _runs(engine, spec, adapters, prompts, choices):
    cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu")
    with open_engine(engine, cfg) as eng:
        return [eng.prompt_logprobs(prompts, c, top_k=5) for c in choices]


def test_super_latent_lora_matches_hf_peft_in_a_mixed_batch(super_tiny):
    """Base, the latent-only adapter, and one batch of three adapters (latent, latent + per-expert experts, the
    mixers) with base rows: every logprob within 1e-4 of HF+PEFT. The latent adapter alone moves the output far above
    that (dropping its LoRA would fail), and each mixed row moves from base where it has an adapter; a base row
    equals the base batch's bit for bit (test_base_rows_neutral.py)."""
    spec, adapters, prompts = super_tiny
    choices = [None, "latent", MIXED]
    ref = _runs("hf", spec, adapters, prompts, choices)
    got = _runs("triton", spec, adapters, prompts, choices)
    for c, g, r in zip(choices, got, ref, strict=True):
        assert _maxdiff(g, r) <= TOL, f"adapter choice {c}: max |d| {_maxdiff(g, r):.2e}"
    assert _maxdiff(got[1], got[0]) > 100 * TOL
    for j, name in enumerate(MIXED):
        moved = float(np.abs(got[2][j].logprobs - got[0][j].logprobs).max())
        assert (moved > 100 * TOL) if name else (moved == 0.0), (name, moved)


def test_bisect_names_super_latent_lora_dropped(super_tiny, monkeypatch):
    """lpdiff bisect's module comparison covers the latent projections (commands/bisect.py "latent"): clean, every
    module within 10x HF's own noise; with the runtime dropping the latent LoRA on load (vLLM 0.25.1's
    vllm-nemotron-latent-dropped, re-created by filtering the parsed adapter), it names the first MoE layer's
    latent_lora of the latent adapter, not the experts and not the layer's hidden state."""
    from lpdiff.engines.triton import nemotron_h_weights as nw
    from lpdiff.harness.commands import bisect as bs

    spec, adapters, prompts = super_tiny
    choices = bs.batch_choices(["latent", "moe"])
    short = bs.equal_length(prompts, 2)
    hf = bs.hf_captures(spec, adapters, choices, short, {"experts_impl": "eager"})
    floors = bs.reference_floor(spec, adapters, choices, short, hf)
    clean = bs.triton_errors(spec, adapters, choices, short, hf)
    assert {"latent", "latent_lora"} <= {m for _, _, m in clean}
    assert bs.first_above(clean, floors, bs.FACTOR) is None, clean

    real = nw._targets

    def latent_dropped(*args):
        dense, experts = real(*args)
        return {k: v for k, v in dense.items() if "latent" not in k[1]}, experts

    monkeypatch.setattr(nw, "_targets", latent_dropped)
    found = bs.first_above(bs.triton_errors(spec, adapters, choices, short, hf), floors, bs.FACTOR)
    assert found is not None and (found.adapter, found.layer, found.module) == ("latent", 1, "latent_lora"), found
    assert found.ratio > 1e3, found
