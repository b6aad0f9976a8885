"""The triton runtime's parts one by one, on the tiny zoo (CPU, fp32): each arch's config reader and gate/up row
order, the prompt batching, routing capture and per-layer capture on an open engine, Nemotron-H's model and Mamba-2
mixer as the runtime's forward for that arch, Qwen3.5's stacked adapters, the vocabulary LoRA, and the TP helpers
at world size 1. Parity of whole forwards with HF+PEFT is in test_engine.py, test_nemotron_h.py and test_qwen35.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.triton import capture, config, gpt_oss, qwen3_moe, tp
from lpdiff.engines.triton.engine import TritonEngine, _batches
from lpdiff.harness.spec.catalog import get_model, hf_config
from lpdiff.harness.types import AdapterSpec
from tests.helpers.paths import REPO

ZOO_ADAPTERS = REPO / "harness" / "zoo_adapters"


def _prompts(n: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 11))] for _ in range(n)]


# -- config readers -----------------------------------------------------------------------------------------------


def test_qwen3_moe_config_reads_the_hf_config_and_refuses_dense_layers():
    hf = hf_config(get_model("tiny-qwen3-moe"))
    cfg = qwen3_moe.config_from_hf(hf)
    assert (cfg.arch, cfg.num_layers, cfg.num_experts, cfg.top_k) == (
        "qwen3_moe",
        hf.num_hidden_layers,
        hf.num_experts,
        hf.num_experts_per_tok,
    )
    assert cfg.expert_width == hf.moe_intermediate_size and cfg.router == "softmax_topk" and cfg.qk_norm
    assert cfg.rope_inv_freq.shape == (cfg.head_dim // 2,)
    hf.mlp_only_layers = [0]
    with pytest.raises(ValueError, match="dense MLP layers"):
        qwen3_moe.config_from_hf(hf)


def test_rope_types_with_length_dependent_frequencies_are_refused():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    hf = hf_config(get_model("tiny-qwen3-moe"))
    inv, scale = config.rope_from_hf(Qwen3MoeRotaryEmbedding, hf)
    want = 1.0 / hf.rope_parameters["rope_theta"] ** (torch.arange(0, inv.numel() * 2, 2).float() / (inv.numel() * 2))
    torch.testing.assert_close(inv, want)
    assert scale == 1.0
    hf.rope_parameters = {**hf.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        config.rope_from_hf(Qwen3MoeRotaryEmbedding, hf)


def test_gpt_oss_gate_up_rows_and_expert_weights_in_the_kernels_layout():
    E, H, I = 3, 5, 4
    g = torch.Generator().manual_seed(random.randrange(2**31))
    hf = {
        "x.gate_up_proj": torch.randn(E, H, 2 * I, generator=g),  # (E, in, out), gate/up columns interleaved
        "x.down_proj": torch.randn(E, I, H, generator=g),
        "x.gate_up_proj_bias": torch.randn(E, 2 * I, generator=g),
        "x.down_proj_bias": torch.randn(E, H, generator=g),
    }
    w_gu, w_down, b_gu, b_down = gpt_oss.expert_weights(hf.__getitem__, "x.")
    gu = hf["x.gate_up_proj"]
    assert torch.equal(w_gu[:, :I], gu[:, :, 0::2].transpose(1, 2)) and torch.equal(w_gu[:, I:], gu[:, :, 1::2].mT)
    assert torch.equal(w_down, hf["x.down_proj"].transpose(1, 2))
    assert torch.equal(b_gu, torch.cat([hf["x.gate_up_proj_bias"][:, 0::2], hf["x.gate_up_proj_bias"][:, 1::2]], 1))
    assert b_down is hf["x.down_proj_bias"]
    # Qwen's fused gate_up is already gate rows then up rows
    t = torch.randn(E, 2 * I, H, generator=g)
    assert qwen3_moe.gate_up_rows(t, 1) is t
    assert qwen3_moe.expert_weights({"y.gate_up_proj": t, "y.down_proj": w_down}.__getitem__, "y.")[0] is t


# -- batching and TP helpers ----------------------------------------------------------------------------------------


def test_batches_are_consecutive_cover_every_prompt_and_respect_the_token_budget():
    rng = random.Random()
    for _ in range(50):
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 100)
        ranges = list(_batches(lens, budget))
        assert [lo for lo, _ in ranges][1:] == [hi for _, hi in ranges][:-1]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(lens)
        for lo, hi in ranges:
            assert hi > lo and (hi - lo == 1 or sum(lens[lo:hi]) <= budget)
            if hi < len(lens):  # greedy: the next prompt did not fit
                assert sum(lens[lo : hi + 1]) > budget


def test_tp_helpers_at_one_rank_and_the_safe_environment():
    x = torch.randn(3)
    assert tp.all_reduce_fn(1)(x) is x
    assert tp.rank_device(torch.device("cpu"), 1) == torch.device("cpu")
    assert tp.rank_device(torch.device("cuda", 2), 1) == torch.device("cuda", 3)
    assert tp.SAFE_ENV["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast stays off in every process lpdiff starts


def test_capture_points_and_steps():
    assert capture.is_input("mamba_in") and capture.is_input("router_ids") and not capture.is_input("hidden")
    cap = {}
    a, b = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(4, 5)
    capture.put_steps(cap, 2, "mamba", {"conv1d": (a, b), "gate": b}, suffix="_base")
    assert set(cap) == {(2, "mamba.conv1d_base"), (2, "mamba.gate_base")}
    assert cap[2, "mamba.conv1d_base"].dtype == torch.float32 and cap[2, "mamba.conv1d_base"].shape == (4, 11)
    torch.testing.assert_close(cap[2, "mamba.conv1d_base"][:, 6:], b)


# -- on an open engine ----------------------------------------------------------------------------------------------


def _engine(model: str, adapters: dict | None = None, **options) -> TritonEngine:
    spec = get_model(model)
    ads = {n: AdapterSpec(n, str(ZOO_ADAPTERS / model / n)) for n in adapters or ()}
    return TritonEngine(EngineConfig(model=spec, adapters=ads, dtype="float32", device="cpu", options=options))


def test_routing_capture_leaves_the_logprobs_and_gives_each_token_its_experts():
    from lpdiff.engines.triton.routing import run_with_routing

    rng = random.Random()
    with _engine("tiny-qwen3-moe", ["all"]) as eng:
        cfg = eng.runtime.cfg
        prompts = _prompts(3, cfg.vocab_size, rng)
        plain = eng.runtime.run(prompts, [0, -1, 0], 0)
        routed = run_with_routing(eng.runtime, prompts, [0, -1, 0], 0)
    for p, r, ids in zip(plain, routed, prompts):
        np.testing.assert_array_equal(p.logprobs, r.logprobs)
        assert r.routed_experts.shape == (len(ids), cfg.num_layers, cfg.top_k)
        assert ((r.routed_experts >= 0) & (r.routed_experts < cfg.num_experts)).all()
        assert all(len(set(row)) == cfg.top_k for row in r.routed_experts.reshape(-1, cfg.top_k).tolist())
        np.testing.assert_allclose(r.routed_weights.sum(-1), 1.0, atol=1e-5)  # norm_topk_prob


def test_capture_layers_hidden_states_per_layer():
    rng = random.Random()
    with _engine("tiny-qwen3-moe") as eng:
        cfg = eng.runtime.cfg
        prompts = _prompts(2, cfg.vocab_size, rng)
        cap = capture.capture_layers(eng, prompts)
    n = sum(len(p) for p in prompts)
    layers = sorted(k[0] for k in cap if k[1] == "hidden")
    assert layers == list(range(len(layers))) and len(layers) >= cfg.num_layers
    assert all(cap[k].shape == (n, cfg.hidden_size) and torch.isfinite(cap[k]).all() for k in cap)


def test_nemotron_h_runs_its_own_model_with_the_mamba_mixer_on_each_mamba_layer(monkeypatch):
    """The arch module's build gives the runtime a NemotronHModel, whose Mamba layers (M in the pattern) go through
    mamba.mamba_mixer: counted by wrapping it, and the logprobs unchanged by the wrapper."""
    from lpdiff.engines.triton import mamba, nemotron_h, nemotron_h_model

    rng = random.Random()
    pattern = hf_config(get_model("tiny-nemotron-h")).hybrid_override_pattern
    with _engine("tiny-nemotron-h", ["mamba"]) as eng:
        assert isinstance(eng.runtime.model, nemotron_h_model.NemotronHModel) and nemotron_h.EMBEDDING_LORA
        prompts = _prompts(2, eng.runtime.cfg.vocab_size, rng)
        before = eng.runtime.run(prompts, [0, -1], 0)
        calls = []

        def counted(*a, **kw):
            calls.append(1)
            return mamba.mamba_mixer(*a, **kw)

        monkeypatch.setattr(nemotron_h_model, "mamba_mixer", counted)
        after = eng.runtime.run(prompts, [0, -1], 0)
    assert len(calls) == pattern.count("M") > 0
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)


def test_qwen35_adapters_stack_into_their_own_slots():
    from lpdiff.engines.triton.qwen3_5_lora import SUPPORTED_TARGETS, Qwen35Lora

    with _engine("tiny-qwen3.5-moe", ["all", "attention"]) as eng:
        lora = eng.runtime.lora
        assert isinstance(lora, Qwen35Lora) and list(lora.names) == ["all", "attention"]
        assert lora.nbytes() > 0
    assert "self_attn.{q,k,v,o}_proj" in SUPPORTED_TARGETS and "linear_attn." in SUPPORTED_TARGETS


def test_model_weights_count_each_tensor_once():
    from lpdiff.engines.triton.weights import ModelWeights

    with _engine("tiny-qwen3-moe") as eng:
        w = eng.runtime.weights
        assert isinstance(w, ModelWeights)
        embed_bytes = w.embed.numel() * w.embed.element_size()
        total = w.nbytes()
        # tied or not, the head and the embedding are counted once each when they are distinct tensors
        assert total > embed_bytes and total == ModelWeights(w.embed, w.norm, w.embed, w.layers).nbytes() + (
            0 if w.lm_head.data_ptr() == w.embed.data_ptr() else w.lm_head.numel() * w.lm_head.element_size()
        )


# -- vocabulary LoRA ------------------------------------------------------------------------------------------------


def _canonical(scaling, dense=None, embed=None, scalings=None):
    from lpdiff.harness.spec.adapters.canonical import CanonicalAdapter

    return CanonicalAdapter(
        rank=4,
        alpha=4 * scaling,
        use_rslora=False,
        scaling=scaling,
        dense=dense or {},
        experts={},
        embed=embed or {},
        scalings=scalings or {},
    )


def test_vocab_lora_head_and_embedding_equal_their_formulas_and_rows_without_adapter_add_nothing():
    from lpdiff.engines.triton.vocab_lora import HEAD, fold_scalings, stack_vocab, without_vocab

    V, H, r = 11, 6, 3
    g = torch.Generator().manual_seed(random.randrange(2**31))
    head = (torch.randn(r, H, generator=g), torch.randn(V, r, generator=g))
    emb = (torch.randn(r, V, generator=g), torch.randn(H, r, generator=g))
    q = (torch.randn(r, H, generator=g), torch.randn(H, r, generator=g))
    a1 = _canonical(2.0, dense={HEAD: head, "model.layers.0.self_attn.q_proj": q}, scalings={HEAD: 0.5})
    a2 = _canonical(1.5, embed={"model.embed_tokens": emb})
    folded = fold_scalings(a1)
    assert folded.scalings == {} and torch.allclose(folded.dense[HEAD][1], head[1] * 0.25)
    assert list(without_vocab(a1).dense) == ["model.layers.0.self_attn.q_proj"] and not without_vocab(a2).embed
    vl = stack_vocab({"a1": folded, "a2": a2}, torch.float32, torch.device("cpu"))
    lm = torch.randn(V, H, generator=g)
    hidden = torch.randn(5, H, generator=g)
    slots = torch.tensor([0, -1, 1, 0, -1])
    got = vl.head_logits(hidden, lm, slots)(0, 5)
    want = hidden @ lm.T
    want[slots == 0] += (hidden[slots == 0] @ head[0].T) @ (0.5 * head[1]).T  # a1's own lm_head scaling
    torch.testing.assert_close(got, want)
    ids = torch.randint(0, V, (5,), generator=g)
    delta = vl.embed_delta(ids, slots)
    want = torch.zeros(5, H)
    want[slots == 1] = 1.5 * emb[0].T[ids[slots == 1]] @ emb[1].T
    torch.testing.assert_close(delta, want)
    assert stack_vocab({"q": _canonical(1.0, dense={"x": q})}, torch.float32, torch.device("cpu")) is None
