"""engines/vllm.py without vLLM: prompt-logprob parsing, top-k mapping, rank slots, option checks. Runs in the main
virtualenv (no vLLM there) and again in the vLLM stage.

The ``Fake*`` classes below are stand-ins for vLLM's output types (``Logprob``, ``FlatLogprobs``), for parsing
tests only: they carry the same fields vLLM 0.25 (list of dicts) and 0.32 (flat lists) return. The real engine runs
against real vLLM in tests/test_vllm_engine.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from engines.base import EngineConfig
from engines.vllm import (VLLMEngine, adapter_max_rank, parse_prompt_logprobs, pick_max_lora_rank,
                          vllm_top_k)
from harness.types import AdapterSpec, ModelSpec


@dataclass
class FakeLogprob:  # stand-in for vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeFlatLogprobs:  # stand-in for vllm.logprobs.FlatLogprobs (0.3x): same field names, flat lists
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def append_row(self, ids, lps):
        """Like vLLM's append_fast: the actual token first, then the top k, duplicates kept."""
        self.start_indices.append(len(self.logprobs))
        self.token_ids += list(ids)
        self.logprobs += list(lps)
        self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)


def vllm_like(token_ids, logits: np.ndarray, k: int, flat: bool):
    """What vLLM returns for prompt_logprobs=k: position 0 None, then the k best plus the actual token, ranked."""
    logz = np.log(np.exp(logits).sum(-1, keepdims=True))
    lp = logits - logz
    entries, fl = [None], FakeFlatLogprobs()
    fl.append_row([], [])
    for i in range(1, len(token_ids)):
        row = lp[i - 1]
        order = np.argsort(-row, kind="stable")
        ids = [int(token_ids[i]), *map(int, order[:k] if k != -1 else order)]  # actual token, then the top k
        fl.append_row(ids, [float(row[t]) for t in ids])
        # a dict merges the duplicate; parsing must not depend on dict order either
        entries.append({t: FakeLogprob(float(row[t])) for t in reversed(ids)})
    return (fl if flat else entries), lp


@pytest.mark.parametrize("flat", [False, True])  # 0.25 list of dicts / 0.32 FlatLogprobs
@pytest.mark.parametrize("k", [0, 3, -1])  # actual token only / top-k / whole vocabulary
def test_parse_matches_the_log_softmax_it_came_from(flat, k):
    g = np.random.default_rng(0)
    vocab, ids = 50, [3, 17, 17, 0, 49, 8]
    logits = g.normal(size=(len(ids) - 1, vocab)) * 3
    entries, lp = vllm_like(ids, logits, k, flat)
    got = parse_prompt_logprobs(ids, entries, top_k=k)
    want = lp[np.arange(len(ids) - 1), ids[1:]]
    assert got.logprobs.dtype == np.float32 and np.allclose(got.logprobs, want, atol=1e-6)
    assert got.token_ids.tolist() == ids
    if k == 0:
        assert got.topk_ids is None
        return
    kk = vocab if k == -1 else k
    best = np.argsort(-lp, axis=1, kind="stable")[:, :kk]
    assert got.topk_ids.shape == (len(ids) - 1, kk)
    assert np.array_equal(got.topk_ids, best)
    assert np.allclose(got.topk_logprobs, np.take_along_axis(lp, best, 1), atol=1e-6)


def test_actual_token_outside_topk_is_not_mistaken_for_topk():
    # token 9 is the actual token but ranks 40th: it is in the dict, it must not enter the top 2
    entries = [None, {9: FakeLogprob(-6.0, 40), 1: FakeLogprob(-0.1, 1), 2: FakeLogprob(-2.5, 2)}]
    got = parse_prompt_logprobs([5, 9], entries, top_k=2)
    assert got.logprobs.tolist() == [-6.0] and got.topk_ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("entries, ids, match", [
    ([None, {1: FakeLogprob(-1.0)}], [5, 9], "lack the actual token 9"),  # a wrong entry must not pass silently
    ([None], [5, 9], "for 1 positions, the prompt has 2"),  # length mismatch
    (None, [5, 9], "prompt_logprobs=k"),  # the request forgot prompt logprobs
])
def test_parse_errors_name_the_problem(entries, ids, match):
    with pytest.raises(ValueError, match=match):
        parse_prompt_logprobs(ids, entries)


def test_parse_refuses_short_topk():
    entries = [None, {9: FakeLogprob(-0.5, 1), 1: FakeLogprob(-1.5, 2)}]
    with pytest.raises(ValueError, match="asked for top 5 logprobs, vLLM returned 2"):
        parse_prompt_logprobs([5, 9], entries, top_k=5)


@pytest.mark.parametrize("top_k, vocab, want", [
    (0, 100, 0),  # actual token only
    (5, 100, 5),
    (-1, 100, -1),  # whole vocabulary, vLLM's spelling
    (100, 100, -1),  # k >= vocab is the whole vocabulary (HF engine spelling)
])
def test_vllm_top_k(top_k, vocab, want):
    assert vllm_top_k(top_k, vocab) == want


def test_vllm_top_k_refuses_negative():
    with pytest.raises(ValueError, match="top_k must be -1"):
        vllm_top_k(-2, 10)


@pytest.mark.parametrize("ranks, want", [
    ([8], 8),
    ([4, 8], 8),  # a rank-4 adapter shares the rank-8 slots
    ([9], 16),  # not an allowed value: next one up
    ([320], 320),
])
def test_pick_max_lora_rank(ranks, want):
    assert pick_max_lora_rank(ranks) == want


def test_pick_max_lora_rank_too_big_names_the_fix():
    with pytest.raises(ValueError, match="exceeds vLLM's largest max_lora_rank 512"):
        pick_max_lora_rank([1024])


def test_adapter_max_rank_reads_rank_pattern(tmp_path):
    import json

    from safetensors.numpy import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 32}}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((32, 4), np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    assert adapter_max_rank(tmp_path) == 32


def test_unknown_option_is_refused_with_the_known_ones():
    cfg = EngineConfig(model=ModelSpec(name="m", arch="qwen3", path="/nonexistent"), options={"max_lora": 2})
    with pytest.raises(ValueError, match=r"unknown vllm engine options \['max_lora'\].*max_loras"):
        VLLMEngine(cfg)


def test_engine_outside_with_block_says_how_to_use_it():
    eng = VLLMEngine(EngineConfig(model=ModelSpec(name="m", arch="qwen3", path="/nonexistent"),
                                  adapters={"a": AdapterSpec("a", "/x")}))
    with pytest.raises(RuntimeError, match="context manager"):
        eng.prompt_logprobs([[1, 2]])


def test_checkpoint_dir_writes_a_layer_cut_model_once(tmp_path):
    # vLLM and SGLang load directories only: a spec cut to num_layers is written out, and loads as the same model
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.vllm import checkpoint_dir
    from harness.catalog import load_hf_model
    from harness.zoo import TINY_CONFIGS

    kw = dict(TINY_CONFIGS["tiny-qwen3-dense"], initializer_range=0.25)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).save_pretrained(
        str(tmp_path / "m"))
    full = ModelSpec(name="m", arch="qwen3", path=str(tmp_path / "m"))
    assert checkpoint_dir(full, tmp_path / "cache") == full.path  # nothing to write
    cut = ModelSpec(name="m", arch="qwen3", path=full.path, num_layers=2)
    out = checkpoint_dir(cut, tmp_path / "cache")
    assert checkpoint_dir(cut, tmp_path / "cache") == out and len(list((tmp_path / "cache").iterdir())) == 1
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        want = load_hf_model(cut, torch.float32, "cpu")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 2 and torch.equal(got, want)
