"""``lpdiff doctor MODEL ADAPTER --verdict prefill|decode`` (harness/cli_engines.py) through click's CliRunner: vLLM's
lm_head LoRA is refused for prefill verdicts only (KnownDefect vllm-lm-head-prompt-logprobs), so a user asking about
a decode verdict is told it is served. No vLLM needed: doctor reads the adapter's files and vLLM's declared facts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from lpdiff.harness.cli import cli

MODEL = "tiny-qwen3-dense"
DEFECT = "vllm-lm-head-prompt-logprobs"
REFUSAL = "vllm    ERROR    lm_head LoRA"  # the text report's line of that finding


@pytest.fixture(scope="module")
def vocab_adapter(tmp_path_factory) -> str:
    """lm_head + embed_tokens LoRA, as trainers that add tokens or tune the head write it."""
    import torch

    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import get_model, load_hf_model

    model = load_hf_model(get_model(MODEL), torch.float32, "cpu")
    root = tmp_path_factory.mktemp("doctor-cli")
    return str(generate_adapter(model, root / "vocab", groups=("lm_head", "embed_tokens"), rank=8, seed=3).path)


def _doctor(*args: str):
    """-> (the command's exit code as lpdiff's main returns it, its output)."""
    res = CliRunner().invoke(cli, ["doctor", MODEL, *args], standalone_mode=False, catch_exceptions=False)
    return res.return_value, res.output


def test_doctor_verdict_scopes_vllms_lm_head_refusal(vocab_adapter):
    # no verdict asked: the findings of both verdicts, the lm_head refusal among them (exit 1)
    rc, out = _doctor(vocab_adapter, "--engine", "vllm")
    assert rc == 1 and REFUSAL in out and "for prefill and decode verdicts (--verdict asks one)" in out, out
    rc, out = _doctor(vocab_adapter, "--engine", "vllm", "--verdict", "prefill")
    assert rc == 1 and REFUSAL in out and "for prefill verdicts only" in out and "#51594" in out, out
    # a decode verdict: vLLM's sampled logprobs are right, nothing refused
    rc, out = _doctor(vocab_adapter, "--engine", "vllm", "--verdict", "decode")
    assert rc == 0 and "lm_head LoRA" not in out and "for decode verdicts only" in out and "vllm    OK" in out, out
    rc, out = _doctor(vocab_adapter, "--engine", "vllm", "--verdict", "decode", "--json")
    report = json.loads(out)
    assert rc == 0 and report["verdict"] == "decode" and report["exit_code"] == 0
    assert DEFECT not in {f["code"] for f in report["findings"]}
    rc, out = _doctor(vocab_adapter, "--engine", "vllm", "--json")
    assert rc == 1 and json.loads(out)["verdict"] == "all" and DEFECT in out


def test_an_unknown_verdict_is_a_usage_error_naming_the_choices(vocab_adapter):
    res = CliRunner().invoke(cli, ["doctor", MODEL, vocab_adapter, "--verdict", "rollout"])
    assert res.exit_code == 2 and "'rollout' is not one of 'prefill', 'decode'" in res.output, res.output
