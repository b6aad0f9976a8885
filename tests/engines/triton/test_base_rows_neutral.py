"""LoRA neutrality inside one triton session, fp32 on CPU: a base row (no adapter) of a batch whose other rows carry
adapters on every module group equals, bit for bit, the same row in a base-only batch of the same prompts. The
adapter rows route their tokens to other experts, so each expert's token count changes with the batch's adapters;
the runtime must not let that reach a base row (kernels/moe_reference.py: MKL's sgemm gives a row a different result
for some row counts, which moved base rows by up to 9.5e-6 on these models).

Models: the tiny Super (tests/helpers/nemotron_tiny.py; adapters on the latent projections, the Mamba-2 mixers'
in_proj / out_proj, the routed experts per expert, attention with the shared expert and lm_head) and the tiny zoo's
Nano, Qwen3.5, Qwen3 and gpt-oss with their committed adapters (every group each one has). The gpu1 twin runs the
same on the Triton kernels (not yet run on a GPU): there a batch with any q|k|v adapter takes its LoRA as extra K
columns of the base GEMM (kernels.lora_linear_aug) and the expert GEMMs take their LoRA kernels, so cuBLAS and the
tile choice may sum a base row otherwise than in a base-only batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.types import AdapterSpec, ModelSpec

# short ragged prompts: an expert gets 1-11 tokens of a layer, the row counts where MKL's sgemm changes kernel
LENS = [2, 2, 3, 2, 2, 3, 2]
SEEDS = tuple(range(8))
ZOO = ["tiny-nemotron-h", "tiny-qwen3.5-moe", "tiny-qwen3-moe", "tiny-gpt-oss"]


def _super(root):
    from lpdiff.harness.spec.adapters import generate_adapter
    from tests.helpers.nemotron_tiny import tiny_super

    model, kw = tiny_super()
    model.save_pretrained(root / "model")
    groups = {
        "latent": dict(groups=("latent",), rank=8),
        "mixer": dict(groups=("mamba",), rank=6),
        "experts": dict(groups=("experts",), rank=4, layout="per_expert"),
        "attn_shared_head": dict(groups=("attention", "shared_expert", "lm_head"), rank=5),
    }
    adapters = {
        n: AdapterSpec(n, str(generate_adapter(model, root / n, seed=i, **g).path))
        for i, (n, g) in enumerate(groups.items())
    }
    return (
        ModelSpec(name="tiny-nemotron-super", arch="nemotron_h", path=str(root / "model")),
        adapters,
        kw["vocab_size"],
    )


def _zoo(name):
    from lpdiff.harness.spec.resolve import resolve_model, zoo_adapters

    spec = resolve_model(name)
    with open(f"{spec.path}/config.json") as f:
        cfg = json.load(f)
    return spec, zoo_adapters(name), cfg.get("text_config", cfg)["vocab_size"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu1)])
@pytest.mark.parametrize("model", ["tiny-nemotron-super", *ZOO])
def test_base_rows_bit_equal_beside_every_adapter(model, device, tmp_path):
    """For fresh random prompts: the base-only batch, then every other row with an adapter (each of the session's
    adapters in turn); each base row's logprobs, top-3 and router margin are bit-equal, and each adapter row moved."""
    spec, adapters, vocab = _super(tmp_path) if model == "tiny-nemotron-super" else _zoo(model)
    names = list(adapters)
    assert len(names) >= 4
    cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device=device)
    with open_engine("triton", cfg) as eng:
        for seed in SEEDS:
            g = torch.Generator().manual_seed(seed)
            prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in LENS]
            base = eng.prompt_logprobs(prompts, None, top_k=3)
            choice = [names[(seed + j // 2) % len(names)] if j % 2 == 0 else None for j in range(len(LENS))]
            mixed = eng.prompt_logprobs(prompts, choice, top_k=3)
            for j, name in enumerate(choice):
                got, want = mixed[j], base[j]
                if name is not None:
                    assert np.abs(got.logprobs - want.logprobs).max() > 1e-3, (seed, j, name)
                    continue
                d = float(np.abs(got.logprobs - want.logprobs).max())
                assert np.array_equal(got.logprobs, want.logprobs), f"seed {seed} row {j}: base row max |d| {d:.2e}"
                assert np.array_equal(got.topk_logprobs, want.topk_logprobs), (seed, j)
                assert np.array_equal(got.topk_ids, want.topk_ids), (seed, j)
                assert np.array_equal(got.router_margin, want.router_margin), (seed, j)
