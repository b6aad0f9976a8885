"""Decode verdicts on CPU (harness/commands/decode.py): the hf engine's KV-cache decode agrees with an hf prefill of
the same sequences in fp32 (greedy and seeded, adapters and base rows in one batch); a temperature applied in decode
only, and a triton bug-zoo fault decoded by re-prefill, FAIL; the engines' decode outputs parse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.engines.base import Decoding, decode
from lpdiff.harness.commands.decode import judge_lane, run_decode
from lpdiff.harness.pipeline.rl_metrics import decode_metrics
from lpdiff.harness.pipeline.thresholds import lookup
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.spec.resolve import resolve

MODEL = "tiny-qwen3-moe"
N = 4


@pytest.fixture(scope="module")
def zoo():
    r = resolve(MODEL, adapters=("all",))
    return r.spec, r.adapters, [p[:16] for p in r.prompts[:2]]


def _threshold(engine: str):
    return lookup(MODEL, f"{engine}:float32-vs-hf:float32", "float32", 1)


@pytest.mark.parametrize(
    "args, what", [((0,), "max_new_tokens"), ((2, "top_p"), "sampling"), ((2, "seeded", -1), "seed")]
)
def test_a_bad_decoding_is_one_input_error_naming_it(args, what):
    """Checked once, where the Decoding is made (engines.base), whichever engine then decodes."""
    with pytest.raises(InputError, match=f"^{what} must be"):
        Decoding(*args)
    assert Decoding(2, "seeded", 0).seed == 0


def test_hf_decode_matches_hf_prefill_of_the_same_sequences(zoo):
    spec, adapters, prompts = zoo
    choice = [None, "all"]
    with open_engine("hf", EngineConfig(spec, adapters, dtype="float32", device="cpu")) as eng:
        greedy, how = decode(eng, prompts, choice, N, "greedy", 0)
        seeded = eng.decode(prompts, choice, Decoding(N, "seeded", 7))
        again = eng.decode(prompts, choice, Decoding(N, "seeded", 7))
        pre = {
            k: eng.prompt_logprobs([g.sequence for g in gens], choice)
            for k, gens in (("greedy", greedy), ("seeded", seeded))
        }
    assert how == "decode"
    for k, gens in (("greedy", greedy), ("seeded", seeded)):
        for g, p in zip(gens, pre[k]):
            assert len(g.tokens) == N and g.logprobs.dtype == np.float32
            assert np.abs(g.logprobs - p.logprobs[-N:]).max() <= 2e-5, k
    assert [g.tokens for g in seeded] == [g.tokens for g in again]  # seeded: reproducible
    assert [g.tokens for g in seeded] != [g.tokens for g in greedy]  # and not the argmax
    for g in greedy:  # greedy picks the argmax: its logprob is the largest of the step
        assert (g.logprobs <= 0).all()


def test_temperature_in_decode_only_fails_the_verdict(zoo, monkeypatch):
    """A planted fault: logits divided by a temperature of 0.8 in decode only (the prefill reference is right)."""
    import lpdiff.engines.hf_decode as hd

    spec, adapters, prompts = zoo
    t = _threshold("hf")
    clean = run_decode(spec, adapters, prompts, "hf", t, max_new_tokens=N, log=lambda s: None)
    assert clean.passed, [ln.reasons for ln in clean.lanes]
    monkeypatch.setattr(hd, "raw_logprobs", lambda logits: torch.log_softmax(logits.float() / 0.8, dim=-1))
    hot = run_decode(spec, adapters, prompts, "hf", t, max_new_tokens=N, log=lambda s: None)
    assert not hot.passed and all(not ln.passed for ln in hot.lanes)
    assert all(ln.metrics.k3 > 1e3 * max(c.metrics.k3, 1e-15) for ln, c in zip(hot.lanes, clean.lanes))


def test_triton_decodes_by_re_prefill_and_its_fault_zoo_fails(zoo):
    spec, adapters, prompts = zoo
    t = _threshold("triton")
    ok = run_decode(spec, adapters, prompts, "triton", t, max_new_tokens=3, log=lambda s: None)
    assert ok.how == "re-prefill" and ok.passed, [ln.reasons for ln in ok.lanes]
    bad = run_decode(
        spec,
        adapters,
        prompts,
        "triton",
        t,
        max_new_tokens=3,
        options={"fault": "topk_weight_missing"},
        log=lambda s: None,
    )
    assert not bad.passed
    with pytest.raises(ValueError, match="seeded sampling needs an engine with its own decode"):
        run_decode(spec, adapters, prompts[:1], "triton", t, max_new_tokens=2, sampling="seeded", log=lambda s: None)


def test_a_non_finite_decode_logprob_fails_naming_lane_prompt_and_position():
    m = decode_metrics([np.array([-1.0, -0.5]), np.array([-1.0, -np.inf])], [np.array([-1.0, -0.5])] * 2)
    lane = judge_lane("all", m, _threshold("hf"))
    assert not lane.passed and "lane all, first in prompt 1 at generated position 1 (engine)" in lane.reasons[0]


def test_vllm_sample_logprobs_parse_from_dicts_and_flat_lists():
    from types import SimpleNamespace as NS

    from lpdiff.engines.vllm.parsing import parse_sample_logprobs

    dicts = [{5: NS(logprob=-0.25), 9: NS(logprob=-2.0)}, {7: NS(logprob=-1.5)}]
    assert parse_sample_logprobs([5, 7], dicts).tolist() == [-0.25, -1.5]
    flat = NS(start_indices=[0, 2], end_indices=[2, 3], token_ids=[9, 5, 7], logprobs=[-2.0, -0.25, -1.5])
    assert parse_sample_logprobs([5, 7], flat).tolist() == [-0.25, -1.5]
    with pytest.raises(ValueError, match="do not hold the sampled token"):
        parse_sample_logprobs([6, 7], dicts)


def test_sglang_decode_request_and_answer():
    from lpdiff.engines.sglang.requests import decode_request, parse_decode

    req = decode_request([[1, 2], [3, 4, 5]], [None, "a"], 2, "seeded", 10)
    assert [p["sampling_seed"] for p in req["sampling_params"]] == [10, 11] and req["lora_path"] == [None, "a"]
    assert all(p["ignore_eos"] and p["max_new_tokens"] == 2 and p["temperature"] == 1.0 for p in req["sampling_params"])
    # SGLang runs with skip_tokenizer_init: fields that need the tokenizer (min_new_tokens, stop strings) raise there
    assert not any({"min_new_tokens", "stop"} & set(p) for p in req["sampling_params"])
    out = [{"meta_info": {"output_token_logprobs": [(-0.5, 8, None), (-1.0, 9, None)]}}] * 2
    gens = parse_decode([[1, 2], [3, 4, 5]], out, 2)
    assert gens[1].sequence == [3, 4, 5, 8, 9] and gens[0].logprobs.tolist() == [-0.5, -1.0]
    with pytest.raises(ValueError, match="generated 2 tokens, 3 were asked"):
        parse_decode([[1, 2], [3, 4, 5]], out, 3)
