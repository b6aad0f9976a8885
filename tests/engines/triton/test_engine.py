"""lpdiff.engines.triton against HF+PEFT (engines.hf) in fp32 on tiny qwen3_moe and gpt_oss models, on CPU.

The tiny models are built here (random init with a wide initializer so that distributions are peaked and an
adapter moves logprobs far above the 1e-4 tolerance) and saved with save_pretrained: Qwen's checkpoint is sharded
(index + per-expert tensors, the on-disk layout transformers writes), gpt-oss's is one fused file. Adapters come
from harness.adapters.generate_adapter in the three layouts the harness makes: peft3d, per_expert, shared-outer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.harness.types import AdapterSpec, ModelSpec
from tests.helpers.triton_tiny import SMALL, TOL, maxdiff, run_triton


def test_parity_with_hf_peft_base_adapters_and_mixed_batch(tiny):
    """One engine per side holds all three adapters; each call is checked against HF+PEFT at 1e-4, and each
    adapter must move the output by far more than the tolerance (else dropping it would pass)."""
    spec, adapters, prompts = tiny
    mixed = ["attn_experts", None, "experts_pe", "shared_outer", "attn_experts"]
    choices = [None, "attn_experts", "experts_pe", "shared_outer", mixed]
    from lpdiff.engines.base import open_engine

    with_hf = {}

    def cfg(engine):
        return EngineConfig(model=spec, adapters=adapters[engine], dtype="float32", device="cpu")

    same_len = [p[:8] for p in prompts]  # equal lengths: attention's padded view is a plain reshape
    with open_engine("hf", cfg("hf")) as hf:
        for i, c in enumerate(choices):
            with_hf[i] = hf.prompt_logprobs(prompts, c, top_k=5)
        hf_same = hf.prompt_logprobs(same_len, mixed)
    with open_engine("triton", cfg("triton")) as tr:
        got = {i: tr.prompt_logprobs(prompts, c, top_k=5) for i, c in enumerate(choices)}
        assert maxdiff(tr.prompt_logprobs(same_len, mixed), hf_same) <= TOL
    for i, c in enumerate(choices):
        assert maxdiff(got[i], with_hf[i]) <= TOL, f"adapter choice {c}"
        for x, y in zip(got[i], with_hf[i]):
            assert x.logprobs.shape == (len(x.token_ids) - 1,) and x.logprobs.dtype == np.float32
            # ties inside the top 5 could swap ids legitimately; with peaked tiny models there are none
            np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
            np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=TOL, rtol=0)
            np.testing.assert_allclose(x.router_margin, y.router_margin, atol=TOL, rtol=0)
    for i in (1, 2, 3):
        effect = maxdiff(got[i], got[0])
        assert effect > 100 * TOL, f"adapter {choices[i]} moves logprobs by only {effect:.2e}"
    # the mixed batch equals each prompt run with its own adapter alone
    for j, name in enumerate(mixed):
        alone = got[0] if name is None else got[choices.index(name)]
        np.testing.assert_allclose(got[4][j].logprobs, alone[j].logprobs, atol=TOL, rtol=0)


def test_triton_interpreter_matches_torch_reference(tiny):
    """The same engine on the Triton kernels (interpreted on CPU) agrees with its torch-reference run."""
    spec, adapters, prompts = tiny
    mixed = ["shared_outer", None, "experts_pe", "attn_experts", None]
    short = [p[:10] for p in prompts]  # the interpreter's cost grows with the grid
    ref = run_triton(spec, adapters, short, mixed, options={"impl": "torch"})
    got = run_triton(spec, adapters, short, mixed, options={"impl": "triton"})
    assert maxdiff(got, ref) <= TOL


def test_attention_kernel_matches_the_sdpa_path(tiny, monkeypatch):
    """attention="triton" (kernels/attention.py, interpreted here: window and sinks inside the kernel) gives the
    engine's fp32 SDPA path's logprobs on the ragged batch, and runs the kernel once per layer."""
    import lpdiff.kernels.attention as ka

    spec, adapters, prompts = tiny
    mixed = ["attn_experts", None, "shared_outer", None, "attn_experts"]
    ref = run_triton(spec, adapters, prompts, mixed, options={"attention": "sdpa"})
    calls, kernel = [], ka.attention

    def counted(*a, **kw):
        calls.append(kw["impl"])
        return kernel(*a, **kw)

    monkeypatch.setattr(ka, "attention", counted)
    got = run_triton(spec, adapters, prompts, mixed, options={"attention": "triton"})
    assert calls == ["triton"] * SMALL["num_hidden_layers"]
    assert maxdiff(got, ref) <= TOL


def test_rank_above_the_kernel_cap_runs_on_the_torch_references(tiny, tmp_path):
    """The LoRA kernels stop at rank 128 (register accumulator); a larger adapter (the exact shared-outer form of
    a real model is rank E*r, 512 for gpt-oss-20b at r 16) must still load and match HF+PEFT, with a warning."""
    from transformers import AutoModelForCausalLM

    from lpdiff.engines.base import open_engine
    from lpdiff.harness.spec.adapters import generate_adapter

    spec, _, prompts = tiny
    big = generate_adapter(
        AutoModelForCausalLM.from_pretrained(spec.path),
        tmp_path / "r130",
        groups=("attention", "experts"),
        rank=130,
        seed=4,
    )
    adapters = {"big": AdapterSpec("big", str(big.path))}
    short = [p[:10] for p in prompts]  # the interpreter runs the base layers
    with pytest.warns(UserWarning, match="rank 130 > 128"):
        got = run_triton(
            spec, {"triton": adapters}, short, ["big", None, "big", "big", None], options={"impl": "triton"}
        )
    with open_engine("hf", EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu")) as hf:
        want = hf.prompt_logprobs(short, ["big", None, "big", "big", None])
    assert maxdiff(got, want) <= TOL


def test_tensor_parallel_2_equals_tp1(tiny):
    """TP=2 over gloo (a spawned worker holds half the heads, half of every expert's width and the matching
    LoRA shards) gives the TP=1 logprobs, with a mixed-adapter batch."""
    spec, adapters, prompts = tiny
    mixed = ["attn_experts", None, "shared_outer", "experts_pe", None]
    tp1 = run_triton(spec, adapters, prompts, mixed)
    tp2 = run_triton(spec, adapters, prompts, mixed, tp=2)
    assert maxdiff(tp2, tp1) <= TOL


def test_bad_input_gives_one_clear_error(tiny):
    from lpdiff.engines.triton import TritonEngine
    from lpdiff.engines.triton.archs import model_config
    from lpdiff.engines.triton.lora import stack_adapters
    from lpdiff.engines.triton.shard import Shard
    from lpdiff.harness.spec.adapters import CanonicalAdapter
    from lpdiff.harness.spec.catalog import hf_config

    spec, adapters, prompts = tiny
    # LoRA on a module the runtime has no LoRA path for must fail loudly, never be dropped
    cfg = model_config(hf_config(spec))
    head = CanonicalAdapter(
        2, 4.0, False, 2.0, {"lm_head": (torch.ones(2, cfg.hidden_size), torch.ones(cfg.vocab_size, 2))}, {}
    )
    with pytest.raises(ValueError, match="targets 'lm_head', which the triton engine does not run LoRA on"):
        stack_adapters(cfg, {"head": head}, Shard(), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"does not support arch 'qwen3'.*supported: qwen3_moe, gpt_oss"):
        TritonEngine(EngineConfig(model=ModelSpec(name="x", arch="qwen3", path="/nonexistent"), device="cpu"))
    with pytest.raises(ValueError, match="unknown triton engine options"):
        TritonEngine(EngineConfig(model=spec, device="cpu", options={"chunk": 3}))
    for bad in ("fused:3", "once:3,4", "fused:0,2", "fast"):  # one count, tiles on once, zero tiles, no such mode
        with pytest.raises(ValueError, match="moe_lora_shrink must be auto, once, fused or fused:G,D"):
            TritonEngine(EngineConfig(model=spec, device="cpu", options={"moe_lora_shrink": bad}))
    with pytest.raises(ValueError, match=r"option moe_padding must be auto or one of .*'compute', 'zero', 'half'"):
        TritonEngine(EngineConfig(model=spec, device="cpu", options={"moe_padding": "skip"}))
    with TritonEngine(
        EngineConfig(model=spec, adapters={"a": AdapterSpec("a", adapters["hf"]["attn_experts"].path)}, device="cpu")
    ) as eng:
        with pytest.raises(KeyError, match=r"unknown adapter 'nope'.*opened with \['a'\]"):
            eng.prompt_logprobs(prompts, "nope")
        with pytest.raises(ValueError, match="prompt 1 has 1 token"):
            eng.prompt_logprobs([prompts[0], [3]])
        with pytest.raises(ValueError, match=r"token id\(s\) outside the vocabulary"):
            eng.prompt_logprobs([[0, 10_000]])
    with pytest.raises(RuntimeError, match="context manager"):
        TritonEngine(EngineConfig(model=spec, device="cpu")).prompt_logprobs(prompts)


@pytest.mark.parametrize(
    "lens,window,sinks,expect",
    [
        ([512] * 8, None, False, True),  # the benchmark's batch: no padding, plain causal (Qwen3): SDPA
        ([512, 480, 500], None, False, True),  # 4% padding: still SDPA
        ([512, 64, 64], None, False, False),  # 58% padding would be computed and thrown away: varlen
        ([512] * 8, 128, False, False),  # a sliding window (gpt-oss): varlen handles it natively
        ([512] * 8, None, True, False),  # sinks: varlen + the logsumexp correction beat SDPA's extra key
    ],
)
def test_attention_picks_padded_sdpa_only_where_it_pays(lens, window, sinks, expect):
    from lpdiff.engines.triton.attention import padded_sdpa_pays
    from lpdiff.engines.triton.batch import Batch

    T = sum(lens)
    b = Batch(
        torch.zeros(T, dtype=torch.long),
        torch.zeros(T, dtype=torch.long),
        torch.zeros(T, dtype=torch.long),
        lens,
        torch.zeros(len(lens) + 1, dtype=torch.int32),
        None,
        None,
        None,
    )
    assert padded_sdpa_pays(b, window, torch.zeros(4) if sinks else None) is expect
