"""vLLM's and SGLang's routed-expert answers -> PromptLogprobs.routed_experts, and the options that ask for them.

Neither engine runs on this CPU machine with MoE models, so their answers are built here as their source writes them
(stand-ins, documented per test): vLLM 0.25.1 ``CompletionOutput.routed_experts`` is an int array
[seq_len, layers, top_k] whose seq_len is the request's ``num_tokens - 1`` (scheduler ``_get_routed_experts``; with
``max_tokens=1``: the prompt length); SGLang puts ``meta_info["routed_experts"]`` as the base64 of the int32 array
[tokens, num_hidden_layers, top_k] (its R3 docs: ``np.frombuffer(b64decode(x), np.int32).reshape(-1, L, K)``).
"""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.sglang.requests import generate_request, parse_batch, parse_routed_experts, server_args
from lpdiff.engines.vllm.parsing import parse_prompt_logprobs
from lpdiff.engines.vllm.parsing import parse_routed_experts as vllm_routed
from lpdiff.harness.types import ModelSpec

RNG = np.random.default_rng(5)


def _ids(n, layers, k, experts=16):
    return np.stack([np.stack([RNG.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(n)])


def test_vllm_routed_experts_one_row_per_prompt_token():
    ids = _ids(7, 3, 2)
    got = vllm_routed(7, ids.astype(np.int64))  # vLLM hands back the reader's int array as it is
    assert got.dtype == np.int32 and got.shape == (7, 3, 2)
    np.testing.assert_array_equal(got, ids)


def test_vllm_routed_experts_missing_last_row_and_hybrid_layers():
    ids = _ids(6, 6, 2)  # a hybrid whose layer axis holds every decoder layer; layers 1 and 4 route
    got = vllm_routed(7, ids, moe_layers=[1, 4])
    assert got.shape == (7, 2, 2)
    np.testing.assert_array_equal(got[:6], ids[:, [1, 4]])
    assert (got[6] == -1).all()  # the last prompt token: no logprob position sees it


def test_vllm_routed_experts_refuses_what_is_not_there():
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        vllm_routed(5, None)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        vllm_routed(5, _ids(2, 3, 2))


def test_vllm_request_output_with_routing_parses_beside_the_logprobs():
    """A RequestOutput stand-in: prompt_logprobs as vLLM 0.25's list of {token: Logprob}, routed_experts on
    outputs[0] (CompletionOutput)."""
    toks = [3, 1, 4, 1, 5]
    entries = [None] + [{t: SimpleNamespace(logprob=-0.5 * i)} for i, t in enumerate(toks[1:], 1)]
    ids = _ids(5, 2, 4)
    out = SimpleNamespace(prompt_logprobs=entries, outputs=[SimpleNamespace(routed_experts=ids)])
    p = parse_prompt_logprobs(toks, out.prompt_logprobs)
    import dataclasses

    p = dataclasses.replace(p, routed_experts=vllm_routed(len(toks), out.outputs[0].routed_experts))
    assert p.routed_experts.shape == (5, 2, 4) and p.logprobs.shape == (4,)


def _sglang_item(toks, ids):
    return {
        "meta_info": {
            "input_token_logprobs": [[None if i == 0 else -0.25 * i, t, None] for i, t in enumerate(toks)],
            "routed_experts": base64.b64encode(ids.astype(np.int32).tobytes()).decode(),
        }
    }


def test_sglang_routed_experts_base64_per_prompt():
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    shape = {"layers": 4, "top_k": 2, "moe_layers": None}
    a, b = _ids(4, 4, 2), _ids(2, 4, 2)  # the second answer without its last token's row
    got = parse_batch(prompts, [_sglang_item(prompts[0], a), _sglang_item(prompts[1], b)], 0, 100, shape)
    np.testing.assert_array_equal(got[0].routed_experts, a)
    np.testing.assert_array_equal(got[1].routed_experts[:2], b)
    assert (got[1].routed_experts[2] == -1).all()


def test_sglang_routed_experts_hybrid_layers_and_errors():
    ids = _ids(3, 6, 2)
    got = parse_routed_experts(
        3, _sglang_item([1, 2, 3], ids)["meta_info"], {"layers": 6, "top_k": 2, "moe_layers": [1, 4]}
    )
    np.testing.assert_array_equal(got, ids[:, [1, 4]])
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        parse_routed_experts(3, {"input_token_logprobs": []}, {"layers": 6, "top_k": 2})
    with pytest.raises(ValueError, match="not \\[at least 2 tokens, 5 layers"):
        parse_routed_experts(3, _sglang_item([1, 2, 3], ids)["meta_info"], {"layers": 5, "top_k": 2})


def test_sglang_asks_for_routing_only_when_told():
    spec = ModelSpec(name="m", arch="qwen3_moe", path="/nonexistent")
    assert "return_routed_experts" not in generate_request([[1, 2]], [None], 0, 10)
    assert generate_request([[1, 2]], [None], 0, 10, routing=True)["return_routed_experts"] is True
    assert "enable_return_routed_experts" not in server_args(EngineConfig(model=spec, dtype="bfloat16"), "/x")
    on = server_args(EngineConfig(model=spec, dtype="bfloat16", options={"capture_routing": True}), "/x")
    assert on["enable_return_routed_experts"] is True


def test_moe_layers_of_a_hybrid_come_from_its_layer_types():
    from transformers import AutoConfig

    from lpdiff.engines.vllm.engine import moe_layer_indices
    from lpdiff.harness.spec.catalog import ZOO_DIR

    assert moe_layer_indices(AutoConfig.from_pretrained(ZOO_DIR / "tiny-nemotron-h")) == [1, 4]
    assert moe_layer_indices(AutoConfig.from_pretrained(ZOO_DIR / "tiny-qwen3-moe")) is None
