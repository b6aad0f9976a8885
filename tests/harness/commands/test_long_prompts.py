"""RL-like long prompts (prompts.rl_prompts, issue 42): chat-templated prompt + response and raw ids, packed short
with long, the longest past the engine's prefill step; judged on the tiny zoo (CPU, triton against HF+PEFT fp32,
both at a prefill step the long prompt crosses). A non-finite logprob anywhere FAILs naming lane, prompt and
position, through ``lpdiff run`` and the verdict path."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from lpdiff.harness.spec import prompts as P


def test_rl_lengths_cross_the_step_and_pack_short_between_long():
    assert P.rl_lengths(1024) == [1000, 16, 300, 48]
    assert P.rl_lengths(40960, 16384) == [18433, 16, 8192, 48, 3000, 300, 1000]  # vLLM's H200 step crossed
    assert P.rl_lengths(262144, 2048)[0] == 16384  # already past the step: RL_LENGTHS as they are
    assert P.rl_lengths(1024, 256)[0] == 1000 and max(P.rl_lengths(4609, 4096)) == 4609
    with pytest.raises(ValueError, match="crosses a prefill step of 8192"):
        P.rl_lengths(1024, 8192)  # the zoo's 1024 positions cannot cross the triton runtime's default step


def test_rl_prompts_are_chat_rollouts_and_raw_ids_of_exact_lengths():
    ids, kinds = P.rl_prompts(1024, kinds=True)
    assert [len(p) for p in ids] == P.rl_lengths(1024) and kinds == ["chat", "raw", "chat", "raw"]
    tok = P._chat_tokenizer(None)
    assert all(0 <= t < 1024 for p in ids for t in p)
    text = tok.decode(ids[0])
    assert text.startswith("<|user|>\n") and "\n<|assistant|>\n" in text and ids[0][-1] == tok.eos_token_id
    assert "<|user|>" not in tok.decode(ids[1])  # raw ids: a window of held-out text
    assert P.named_prompts("rl") == ids
    with pytest.raises(KeyError, match="rl \\(RL-like"):
        P.named_prompts("no-such-set")


def test_rl_prompts_use_the_tokenizers_own_chat_template(tmp_path):
    """A tokenizer with a chat template formats the question with it (the plain template is only the fallback)."""
    d = tmp_path / "tok"
    shutil.copytree(P.ZOO_TOKENIZER.parent, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ids, kinds = P.rl_prompts(1024, tokenizer=d, kinds=True)
    tok = P._chat_tokenizer(d)
    assert kinds[0] == "chat" and len(ids[0]) == 1000
    assert tok.decode(ids[0]).startswith("<|endoftext|>user: ") and "<|user|>" not in tok.decode(ids[0])
    assert ids[1] == P.rl_prompts(1024)[1]  # the same text cut with the same tokenizer: the same raw window


def test_triton_on_rl_prompts_past_its_step_passes_against_hf_and_a_fault_fails(tmp_path_factory):
    """The tiny zoo at 2 layers (CPU): the RL set capped at the zoo's 1024 positions, the triton runtime and the HF
    references at a 256-token step (max_batch_tokens), so the 1000-token rollout runs alone past it and the short
    ones pack together; every correct lane PASSes against HF+PEFT fp32, a bug-zoo fault FAILs."""
    from lpdiff.engines.base import capabilities
    from lpdiff.harness.commands import check
    from lpdiff.harness.pipeline.store import BaselineStore

    step = 256
    opts = {"max_batch_tokens": step}
    assert capabilities("triton").prefill_step_for("qwen3_moe", opts) == step
    plans = tuple(p for p in check.ADAPTERS if p.name in ("all", "broken"))
    case = check.build_case(
        "tiny-qwen3-moe", 2, tmp_path_factory.mktemp("rl"), plans=plans, device="cpu", lengths=(16,), log=lambda s: None
    )
    case.prompts = P.rl_prompts(1024, step)
    assert max(map(len, case.prompts)) > step and min(map(len, case.prompts)) == 16
    store = BaselineStore(tmp_path_factory.mktemp("store"))
    res = check.run_check(
        check.CheckRequest(case, "triton", dtype="float32", k=2, options=opts), store=store, log=lambda s: None
    )
    assert res.error is None and res.as_expected, check.format_result(res)
    assert all(v.metrics.num_positions == sum(map(len, case.prompts)) - len(case.prompts) for v in res.verdicts)
    bad = check.run_check(
        check.CheckRequest(case, "triton", dtype="float32", k=2, options={**opts, "fault": "topk_weight_missing"}),
        store=store,
        log=lambda s: None,
    )
    assert not bad.as_expected


# -- non-finite logprobs -------------------------------------------------------------------------------------------


def _run(values):
    from lpdiff.harness.types import LogprobRun, PromptLogprobs

    return LogprobRun([PromptLogprobs(np.arange(len(v) + 1), np.asarray(v, dtype=np.float32)) for v in values])


def test_a_reference_inf_fails_naming_lane_prompt_position_and_side_whatever_else():
    from lpdiff.harness.pipeline.metrics import compare
    from lpdiff.harness.pipeline.thresholds import Threshold
    from lpdiff.harness.pipeline.verdict import judge

    a = _run([[-1.0, -2.0], [-1.0, -2.0, -3.0]])
    b = _run([[-1.0, -2.0], [-1.0, -np.inf, -3.0]])
    t = Threshold(k2=1e9, max_abs=1e9, delta_fidelity=None, source="unmeasured")  # nothing else could fail
    v = judge(compare(a, b), t, adapter="all")
    assert not v.passed
    assert (
        v.reasons[0] == "1 of 5 positions have a NaN or inf logprob: lane all, first in prompt 1 at position 1 "
        "(reference)"
    )


def test_a_nan_after_a_router_near_tie_is_not_excluded():
    """judge(exclude_near_ties=True) judges the clean positions; a NaN among the excluded ones still FAILs."""
    from lpdiff.harness.pipeline.metrics import compare
    from lpdiff.harness.pipeline.thresholds import Threshold
    from lpdiff.harness.pipeline.verdict import judge

    a, b = _run([[-1.0, -2.0, -3.0, -4.0]]), _run([[-1.0, -2.0, -3.0, -4.0]])
    a.prompts[0].logprobs[3] = np.nan
    for r in (a, b):
        r.prompts[0].router_margin = np.array([1.0, 1.0, 1.0, 1e-9, 1.0], dtype=np.float32)  # tie at token 3
    m = compare(a, b)
    assert m.clean.num_nonfinite == 0 and m.num_nonfinite == 1
    t = Threshold(k2=1e9, max_abs=1e9, delta_fidelity=None, source="unmeasured")
    v = judge(m, t, adapter="base", exclude_near_ties=True)
    assert not v.passed and "lane base, first in prompt 0 at position 3 (engine)" in v.reasons[0]


def test_lpdiff_run_fails_a_planted_nan_naming_lane_prompt_and_position(monkeypatch, tmp_path, capsys):
    """``lpdiff run --engine hf`` (the install self-check: otherwise a PASS) with one NaN planted in the engine's
    output at a known lane, prompt and position: exit 1, and the verdict's reason names all three."""
    from lpdiff.engines.hf import HFEngine
    from lpdiff.harness.cli import main

    real = HFEngine.prompt_logprobs

    def planted(self, prompts, adapter=None, top_k=0):
        out = real(self, prompts, adapter, top_k)
        lanes = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        rows = [i for i, a in enumerate(lanes) if a == "attention"]
        if rows:
            out[rows[2]].logprobs[5] = np.nan
        return out

    monkeypatch.setattr(HFEngine, "prompt_logprobs", planted)
    js = tmp_path / "v.json"
    assert (
        main(["run", "--engine", "hf", "--model", "tiny-qwen3-moe", "--adapter", "attention", "--json", str(js)]) == 1
    )
    verdicts = {v["adapter"]: v for v in json.loads(js.read_text())["verdicts"]}
    assert verdicts["-"]["passed"] and not verdicts["attention"]["passed"]
    want = "lane attention, first in prompt 2 at position 5 (engine)"
    assert want in verdicts["attention"]["reasons"][0]
    assert want in " ".join(capsys.readouterr().out.split())
