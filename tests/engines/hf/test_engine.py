"""The hf reference engine against a direct transformers + PEFT computation (full logits, log_softmax)."""

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.harness.types import AdapterSpec, ModelSpec

PROMPTS = [list(range(5, 29)), list(range(40, 51)), list(range(7, 70)), [3, 4]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    cfg = Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d / "m")
    for seed, name in [(1, "a"), (2, "b")]:
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_pretrained(d / "m")
        lcfg = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
        get_peft_model(m, lcfg).save_pretrained(d / name)
    return d


def direct_logprobs(d, prompt, adapter):
    model = AutoModelForCausalLM.from_pretrained(d / "m")
    if adapter:
        model = PeftModel.from_pretrained(model, d / adapter)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        lp = model(ids).logits.float().log_softmax(-1)[0, :-1]
    return lp.gather(1, ids[0, 1:, None])[:, 0].numpy(), lp.numpy()


def test_matches_direct_peft_with_mixed_adapters(tiny):
    cfg = EngineConfig(
        ModelSpec("t", "qwen3_moe", path=str(tiny / "m")), adapters={n: AdapterSpec(n, str(tiny / n)) for n in "ab"}
    )
    choice = ["a", None, "b", "a"]
    with open_engine("hf", cfg) as eng:
        got = eng.prompt_logprobs(PROMPTS, adapter=choice, top_k=5)
        alone = eng.prompt_logprobs(PROMPTS[2:3], adapter="b")  # batch of one: same numbers
    for res, prompt, a in zip(got, PROMPTS, choice):
        want, full = direct_logprobs(tiny, prompt, a)
        np.testing.assert_allclose(res.logprobs, want, atol=2e-5)
        top = np.sort(full, axis=-1)[:, ::-1][:, :5]
        np.testing.assert_allclose(res.topk_logprobs, top, atol=2e-5)
        assert res.router_margin is not None and (res.router_margin >= 0).all()
    np.testing.assert_allclose(alone[0].logprobs, got[2].logprobs, atol=2e-5)
    # the two adapters really differ and really act
    assert np.abs(got[0].logprobs - direct_logprobs(tiny, PROMPTS[0], None)[0]).max() > 1e-3


def test_bad_input_gives_one_clear_error(tiny):
    cfg = EngineConfig(
        ModelSpec("t", "qwen3_moe", path=str(tiny / "m")), adapters={"a": AdapterSpec("a", str(tiny / "a"))}
    )
    with open_engine("hf", cfg) as eng:
        with pytest.raises(KeyError, match="unknown adapter 'zzz'"):
            eng.prompt_logprobs(PROMPTS, adapter="zzz")
        with pytest.raises(ValueError, match="at least 2"):
            eng.prompt_logprobs([[1]])
    with pytest.raises(ValueError, match="unknown hf engine options"):
        open_engine("hf", EngineConfig(ModelSpec("t", "qwen3_moe", path=str(tiny / "m")), options={"nope": 1}))
    with pytest.raises(KeyError, match="known engines"):
        open_engine("nosuch", cfg)
