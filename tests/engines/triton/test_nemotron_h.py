"""lpdiff.engines.triton on Nemotron-H against HF+PEFT (engines.hf) in fp32 on CPU, and kernels/ssd.py's sequence
ops against their definitions.

Two models: the tiny zoo's (harness/zoo/tiny-nemotron-h: M E * M E -, chunk 32) with its committed adapters, and a
smaller one built here with what the zoo model lacks: Super's latent projections, group-limited top-k (n_group 2),
a non-zero router correction bias (random init leaves it zero) and one mamba group (split over TP 2), adapted on
every group the generator writes (latent, experts in the per-expert layout, mamba, attention, shared expert,
embed_tokens, lm_head) at three different ranks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.harness.types import AdapterSpec, ModelSpec

TOL = 1e-4
ZOO = "tiny-nemotron-h"
ZOO_LENS = [16, 300, 5, 47, 33]  # 300 crosses nine of the zoo model's 32-token SSD chunks


def _prompts(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b))


def _runs(engine, spec, adapters, prompts, choices, **kw):
    cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu", **kw)
    with open_engine(engine, cfg) as eng:
        return [eng.prompt_logprobs(prompts, c, top_k=5) for c in choices]


@pytest.fixture(scope="module")
def zoo():
    from lpdiff.harness.spec.resolve import resolve_model, zoo_adapters

    ads = zoo_adapters(ZOO)
    return resolve_model(ZOO), {n: ads[n] for n in ("all", "mamba", "experts")}, _prompts(ZOO_LENS, 1024, 3)


MIXED = ["all", None, "mamba", "experts", None]


@pytest.fixture(scope="module")
def zoo_hf(zoo):
    spec, adapters, prompts = zoo
    return _runs("hf", spec, adapters, prompts, [None, "all", MIXED])


def test_zoo_parity_base_adapters_and_mixed_batch(zoo, zoo_hf):
    """Base, one adapter, and a batch mixing three adapters with base rows, prompts of 5..300 tokens packed
    together: every logprob, top-5 and router margin within 1e-4 of HF+PEFT; each adapter moves the output far
    more than that (else dropping it would pass)."""
    spec, adapters, prompts = zoo
    got = _runs("triton", spec, adapters, prompts, [None, "all", MIXED])
    for c, g, r in zip([None, "all", MIXED], got, zoo_hf):
        assert _maxdiff(g, r) <= TOL, f"adapter choice {c}: max |d| {_maxdiff(g, r):.2e}"
        for x, y in zip(g, r):
            np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
            np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=TOL, rtol=0)
            np.testing.assert_allclose(x.router_margin, y.router_margin, atol=TOL, rtol=0)
    assert _maxdiff(got[1], got[0]) > 100 * TOL
    for j, name in enumerate(MIXED):  # each mixed row moved from base exactly where it has an adapter
        moved = float(np.abs(got[2][j].logprobs - got[0][j].logprobs).max())
        assert (moved > 100 * TOL) if name else (moved == 0.0), (name, moved)


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    """A Nemotron-H with latent MoE, group-limited routing and a random correction bias, saved as transformers
    saves it (backbone. names, experts one by one), with two adapters that together cover every group."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.harness.spec.adapters import generate_adapter

    root = tmp_path_factory.mktemp("nemotron_latent")
    cfg = AutoConfig.for_model(
        "nemotron_h",
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=5,
        layers_block_type=["mamba", "moe", "attention", "mamba", "moe"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=1,
        ssm_state_size=8,
        chunk_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        intermediate_size=40,
        moe_latent_size=32,
        n_group=2,
        topk_group=1,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for i in (1, 4):
            model.model.layers[i].mixer.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(root / "model")
    adapters = {
        "moe": generate_adapter(model, root / "moe", groups=("latent", "experts"), rank=4, seed=1, layout="per_expert"),
        "mixers": generate_adapter(
            model, root / "mixers", groups=("mamba", "attention", "shared_expert"), rank=6, seed=2
        ),
        "vocab": generate_adapter(model, root / "vocab", groups=("embed_tokens", "lm_head", "mamba"), rank=5, seed=4),
    }
    spec = ModelSpec(name="tiny-nemotron-latent", arch="nemotron_h", path=str(root / "model"))
    return spec, {n: AdapterSpec(n, a.path) for n, a in adapters.items()}, _prompts([9, 21, 4, 17], 96, 5)


def test_latent_group_routing_every_group(latent):
    """Latent MoE, group-limited top-k and a correction bias; every adapter group (the vocabulary ones too: embedding
    LoRA in the model, lm_head LoRA in the runtime's log-softmax), alone and mixed with base rows."""
    spec, adapters, prompts = latent
    choices = [None, "moe", "mixers", "vocab", ["mixers", None, "moe", "vocab"]]
    ref = _runs("hf", spec, adapters, prompts, choices)
    got = _runs("triton", spec, adapters, prompts, choices)
    for c, g, r in zip(choices, got, ref):
        assert _maxdiff(g, r) <= TOL, f"adapter choice {c}: max |d| {_maxdiff(g, r):.2e}"
    for i in (1, 2, 3):
        assert _maxdiff(got[i], got[0]) > 100 * TOL, choices[i]


def test_latent_tp2_splits_a_mamba_group_over_ranks(latent):
    """TP 2 over gloo with one mamba group: its B/C replicated on both ranks and its gated norm's sum of squares
    all-reduced; latent fc1 replicated and fc2 on each rank's partial expert sum. The zoo model's TP 2 (whole groups
    per rank) is judged in suites/test_tiny_zoo.py."""
    spec, adapters, prompts = latent
    mixed = [["mixers", None, "moe", "vocab"]]
    (ref,) = _runs("hf", spec, adapters, prompts, mixed)
    (got,) = _runs("triton", spec, adapters, prompts, mixed, tp=2)
    assert _maxdiff(got, ref) <= TOL


def test_latent_triton_kernels_match_torch(latent):
    """impl=triton (the LoRA linear and relu² expert kernels interpreted on CPU) agrees with the torch path."""
    spec, adapters, prompts = latent
    mixed = [["moe", None, "mixers", "moe"]]
    short = [p[:6] for p in prompts]
    (ref,) = _runs("triton", spec, adapters, short, mixed, options={"impl": "torch"})
    (got,) = _runs("triton", spec, adapters, short, mixed, options={"impl": "triton"})
    assert _maxdiff(got, ref) <= TOL


# -- kernels/ssd.py against their definitions --------------------------------------------------------------------


def test_ssd_scan_matches_the_recurrence():
    """Odd sizes: length 45 over chunks of 8 (a partial last chunk), 6 heads in 3 groups, an initial state."""
    from lpdiff.kernels.ssd import discretise_dt, ssd_scan

    g = torch.Generator().manual_seed(11)
    b, l, h, p, grp, n = 3, 45, 6, 5, 3, 7
    x, raw_dt = torch.randn(b, l, h, p, generator=g), torch.randn(b, l, h, generator=g)
    A, D, bias = -torch.rand(h, generator=g) * 2, torch.randn(h, generator=g), torch.randn(h, generator=g)
    B, C = torch.randn(b, l, grp, n, generator=g), torch.randn(b, l, grp, n, generator=g)
    s0 = torch.randn(b, h, p, n, generator=g)
    dt = discretise_dt(raw_dt, bias, 0.01)
    assert dt.min() >= 0.01
    y, final = ssd_scan(x, dt, A, B, C, 8, D, s0, return_state=True)
    state, ys = s0.clone(), []
    Bh, Ch = B.repeat_interleave(h // grp, 2), C.repeat_interleave(h // grp, 2)
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    torch.testing.assert_close(y, torch.stack(ys, 1), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, state, atol=2e-5, rtol=1e-5)


def test_causal_conv1d_and_gated_norm_match_their_definitions():
    from lpdiff.kernels.gated_norm import gate_then_norm
    from lpdiff.kernels.ssd import causal_conv1d

    g = torch.Generator().manual_seed(12)
    x, w, bias = torch.randn(2, 13, 9, generator=g), torch.randn(9, 4, generator=g), torch.randn(9, generator=g)
    want = torch.zeros_like(x)
    for t in range(13):
        for j in range(4):  # tap j reads x[t - j] with weight column K-1-j; before the row's start: nothing
            if t - j >= 0:
                want[:, t] += w[:, 3 - j] * x[:, t - j]
    torch.testing.assert_close(causal_conv1d(x, w, bias), torch.nn.functional.silu(want + bias))
    y, z, weight = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g), torch.randn(12, generator=g)
    got = gate_then_norm(y, z, weight, 4, 1e-5, torch.float32)
    v = (y * torch.nn.functional.silu(z)).view(5, 3, 4)
    torch.testing.assert_close(got, weight * (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)).view(5, 12))


def test_mamba_groups_that_neither_divide_nor_split_over_tp_are_refused():
    from lpdiff.engines.triton.nemotron_h_weights import config_from_hf, mamba_rows
    from lpdiff.engines.triton.shard import Shard
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.spec.resolve import resolve_model

    cfg = dataclasses.replace(config_from_hf(hf_config(resolve_model(ZOO))), n_groups=3)
    with pytest.raises(ValueError, match="3 mamba groups do not split over tp=2"):
        mamba_rows(cfg, Shard(0, 2))


@pytest.mark.parametrize("lens", [[5, 23, 1, 14], [41]])
def test_varlen_kernels_match_their_references(lens):
    """kernels/ssd_varlen.py interpreted on CPU against the padded torch ops: ragged prompts (one of a single token),
    odd widths (37 conv channels, head_dim 10, state 7, 3 groups of 2 heads); the whole pack read as one prompt too
    (how the conv_across_prompts / state_not_reset faults run on the kernels)."""
    from lpdiff.kernels.ssd import discretise_dt
    from lpdiff.kernels.ssd_varlen import causal_conv1d_varlen, ssd_scan_varlen

    g = torch.Generator().manual_seed(sum(lens))
    T = sum(lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    whole = torch.tensor([0, T], dtype=torch.int32)
    x, w, b = torch.randn(T, 37, generator=g), torch.randn(37, 4, generator=g), torch.randn(37, generator=g)
    for c, p in ((cu, pos), (whole, torch.arange(T))):
        ref = causal_conv1d_varlen(x, w, b, p, c, impl="torch")
        torch.testing.assert_close(causal_conv1d_varlen(x, w, b, p, c, impl="triton"), ref, atol=1e-5, rtol=1e-5)
    h, p, grp, n = 6, 10, 3, 7
    xs = torch.randn(T, h, p, generator=g)
    dt = discretise_dt(torch.randn(T, h, generator=g), torch.randn(h, generator=g), 0.001)
    A, D = -torch.rand(h, generator=g) * 2, torch.randn(h, generator=g)
    B, C = torch.randn(T, grp, n, generator=g), torch.randn(T, grp, n, generator=g)
    for c in (cu, whole):
        ref = ssd_scan_varlen(xs, dt, A, B, C, D, c, 8, impl="torch")
        got = ssd_scan_varlen(xs, dt, A, B, C, D, c, 8, impl="triton")
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    if len(lens) > 1:  # a reset matters: the one-prompt reading differs after the first prompt
        assert not torch.allclose(
            ssd_scan_varlen(xs, dt, A, B, C, D, whole, 8, impl="torch")[lens[0] :],
            ssd_scan_varlen(xs, dt, A, B, C, D, cu, 8, impl="torch")[lens[0] :],
        )
