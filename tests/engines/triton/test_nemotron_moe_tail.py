"""Nemotron-H's MoE tail folded into the next residual add + RMSNorm at TP 1 (nemotron_h_model.moe_parts): the routed
experts hand the norm their (T, K, H) top-k outputs unsummed and the shared expert its (T, H) output, and the norm
sums them (norm.moe_delta's roundings). Super's latent MoE sums in the latent dim before fc2_latent_proj, so its
fc2 output (T, H) rides with the shared expert's.

Two tiny models built here whose last layer is a MoE layer (its parts go into the model's final norm): a plain one
(top-3 of 8 experts) and a latent one. fp32 on CPU with impl "triton", the path the GPU runs (the expert kernels
interpreted; the norm is its torch reference in-process, which sums the parts as the Triton kernel does), several
adapters and a base row in one batch: the fold reaches every MoE layer, the logprobs equal the unfused path's within
fp32 rounding and HF+PEFT's within the parity tolerance, and the shared_expert_dropped fault still moves them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.engines.triton import nemotron_h_model
from lpdiff.harness.types import AdapterSpec, ModelSpec

TOL = 1e-4
LENS = [7, 12, 3, 9]
MIXED = ["moe", None, "mixers", "moe"]
PATTERNS = {"plain": ["moe", "mamba", "attention", "moe"], "latent": ["mamba", "moe", "attention", "moe"]}


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=list(PATTERNS))
def tiny(request, tmp_path_factory):
    """-> (ModelSpec, adapters, prompts, number of MoE layers) of a tiny Nemotron-H ending in a MoE layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.harness.spec.adapters import generate_adapter

    kind, blocks = request.param, PATTERNS[request.param]
    root = tmp_path_factory.mktemp(f"nemotron_tail_{kind}")
    cfg = AutoConfig.for_model(
        "nemotron_h",
        vocab_size=96,
        hidden_size=48,
        num_hidden_layers=len(blocks),
        layers_block_type=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        mamba_num_heads=6,
        mamba_head_dim=8,
        n_groups=1,
        ssm_state_size=8,
        chunk_size=8,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=20,
        moe_shared_expert_intermediate_size=28,
        intermediate_size=28,
        moe_latent_size=32 if kind == "latent" else None,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(root / "model")
    moe_groups = ("latent", "experts", "shared_expert") if kind == "latent" else ("experts", "shared_expert")
    adapters = {
        "moe": generate_adapter(model, root / "moe", groups=moe_groups, rank=4, seed=1, layout="per_expert"),
        "mixers": generate_adapter(model, root / "mixers", groups=("mamba", "attention"), rank=6, seed=2),
    }
    spec = ModelSpec(name=f"tiny-nemotron-tail-{kind}", arch="nemotron_h", path=str(root / "model"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in LENS]
    return spec, {n: AdapterSpec(n, a.path) for n, a in adapters.items()}, prompts, blocks.count("moe"), kind


def _triton(spec, adapters, prompts, fault: str | None = None, choices=(None, MIXED)):
    """{fused, unfused: logprobs of each choice} from one engine (impl triton), and the parts the norms received."""
    options = {"impl": "triton"} | ({"fault": fault} if fault else {})
    cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu", options=options)
    seen: list[tuple[int, bool]] = []
    norm = nemotron_h_model.add_rms_norm

    def spy(x, delta, *a):
        if len(a) > 5 and a[5] is not None:  # add_rms_norm(x, delta, w, eps, weight_fp32, impl, out, shared)
            seen.append((delta.ndim, tuple(a[5].shape) == tuple(x.shape)))
        return norm(x, delta, *a)

    out = {}
    with open_engine("triton", cfg) as eng, pytest.MonkeyPatch.context() as mp:
        model = eng.runtime.model
        assert model.fuse_moe_tail  # TP 1
        mp.setattr(nemotron_h_model, "add_rms_norm", spy)
        out["fused"] = [eng.prompt_logprobs(prompts, c) for c in choices]
        calls = list(seen)
        model.fuse_moe_tail = False  # the unfused path: the mixer's summed (T, H) output, as under TP
        seen.clear()
        out["unfused"] = [eng.prompt_logprobs(prompts, c) for c in choices]
        assert seen == [], "the unfused path hands the norm no parts"
    return out, calls


@pytest.fixture(scope="module")
def clean(tiny):
    spec, adapters, prompts, _, _ = tiny
    return _triton(spec, adapters, prompts)


def test_moe_tail_folds_into_the_next_norm_and_matches_the_unfused_path(tiny, clean):
    spec, adapters, prompts, n_moe, kind = tiny
    out, calls = clean
    # every MoE layer of both forwards, the last one into the final norm; the plain model's routed experts unsummed
    # (T, 3, H), the latent one's fc2 output (T, H)
    assert calls == [(2 if kind == "latent" else 3, True)] * (2 * n_moe), calls
    for f, u in zip(out["fused"], out["unfused"]):
        assert _maxdiff(f, u) <= 1e-5, _maxdiff(f, u)
    ref = []
    cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu")
    with open_engine("hf", cfg) as eng:
        ref = [eng.prompt_logprobs(prompts, c) for c in (None, MIXED)]
    for c, got, want in zip((None, MIXED), out["fused"], ref):
        assert _maxdiff(got, want) <= TOL, f"{kind} adapter choice {c}: max |d| {_maxdiff(got, want):.2e}"
    for j, name in enumerate(MIXED):  # each mixed row moved from base where it has an adapter, and only there
        # (a base row may move by fp32 rounding here, 4.8e-7 fused or not: on this CPU path the LoRA linears are MKL
        # GEMMs, whose sums depend on the row count; test_base_rows_neutral.py pins the default path bit for bit)
        for path in ("fused", "unfused"):
            moved = float(np.abs(out[path][1][j].logprobs - out[path][0][j].logprobs).max())
            assert (moved > 100 * TOL) if name else (moved <= 1e-5), (name, path, moved)


def test_shared_expert_dropped_still_bites_when_folded(tiny, clean):
    """The fault zeroes the shared expert's part: folded or not, the output moves far from the clean run's."""
    spec, adapters, prompts, _, kind = tiny
    dropped, calls = _triton(spec, adapters, prompts, fault="shared_expert_dropped", choices=(MIXED,))
    assert calls, "the fold ran under the fault"
    for path in ("fused", "unfused"):
        assert _maxdiff(dropped[path][0], clean[0][path][1]) > 100 * TOL, (kind, path)
    assert _maxdiff(dropped["fused"][0], dropped["unfused"][0]) <= 1e-5, kind
