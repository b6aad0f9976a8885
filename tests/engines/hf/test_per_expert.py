"""The hf reference engine computes a per-expert adapter as its PEFT 3D original: it converts the file exactly
before PEFT loads it, because PEFT 0.21 on transformers 5's fused gpt-oss experts drops the routed-expert tensors
of a per-expert file (attention targets still load) and refuses an experts-only one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.harness.spec.adapters import WEIGHTS_NAME, convert_adapter
from lpdiff.harness.spec.catalog import hf_config
from lpdiff.harness.spec.resolve import resolve
from lpdiff.harness.types import AdapterSpec

MODEL = "tiny-gpt-oss"  # where PEFT alone gets the per-expert layout wrong


def _perturbed(src: Path, dst: Path, key_part: str) -> Path:
    """A copy of the per-expert adapter ``src`` with one expert's LoRA B (keys containing ``key_part``) negated."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != WEIGHTS_NAME:
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / WEIGHTS_NAME))
    hit = [k for k in tensors if key_part in k and ".lora_B." in k]
    assert hit, f"no LoRA B key contains {key_part!r}"
    save_file(
        {k: -v if k in hit else v for k, v in tensors.items()}, str(dst / WEIGHTS_NAME), metadata={"format": "pt"}
    )
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pe")
    r = resolve(MODEL, adapters=("all",))
    src = Path(r.adapters["all"].path)
    pe = Path(convert_adapter(src, tmp / "pe", "per_expert", hf_config(r.spec)).path)
    assert json.loads((pe / "adapter_config.json").read_text())["target_parameters"] is None  # no 3D entries left
    bad = _perturbed(pe, tmp / "pe_bad", ".layers.0.mlp.experts.1.down_proj.")
    adapters = {"p3d": src, "pe": pe, "pe_bad": bad}
    cfg = EngineConfig(r.spec, {n: AdapterSpec(n, str(p)) for n, p in adapters.items()}, dtype="float32", device="cpu")
    prompts = r.prompts[:4]
    with open_engine("hf", cfg) as eng:
        got = {n: eng.prompt_logprobs(prompts, adapter=n) for n in adapters}
    return r, pe, prompts, {n: np.concatenate([p.logprobs for p in v]) for n, v in got.items()}


def test_per_expert_file_gives_the_peft3d_logprobs(runs):
    *_, lp = runs
    assert np.abs(lp["pe"] - lp["p3d"]).max() <= 1e-6


def test_one_expert_perturbed_changes_the_logprobs(runs):
    """The comparison above can fail: one expert's down B of one layer negated moves the logprobs."""
    *_, lp = runs
    assert np.abs(lp["pe_bad"] - lp["p3d"]).max() > 1e-3


def test_peft_alone_drops_the_per_expert_experts(runs):
    """Why the engine converts: PEFT 0.21 loading the per-expert file itself computes another adapter (attention
    only). The day PEFT reads it, this fails and the conversion can be reconsidered."""
    from peft import PeftModel

    from lpdiff.harness.spec.catalog import load_hf_model

    r, pe, prompts, lp = runs
    model = PeftModel.from_pretrained(load_hf_model(r.spec, torch.float32, "cpu"), str(pe)).eval()
    got = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logp = model(ids).logits.float().log_softmax(-1)[0, :-1]
            got.append(logp.gather(1, ids[0, 1:, None])[:, 0].numpy())
    assert np.abs(np.concatenate(got) - lp["p3d"]).max() > 1e-2


@pytest.mark.parametrize("model,root", [("tiny-qwen3.5-moe", "model.language_model"), ("tiny-nemotron-h", "backbone")])
def test_adapter_named_under_the_checkpoints_root_is_read_as_the_text_named_one(tmp_path, model, root):
    """PEFT on the Hub's Qwen3.5 class writes ``model.language_model.layers.*``; transformers builds the text model
    (decoder ``model``), where PEFT 0.21 places none of those tensors and runs the base model without a word (without
    the hf engine's conversion the rooted lane equals the base). Nemotron-H files naming ``backbone.layers.*`` PEFT
    maps itself. The reference must compute both as the text-named file."""
    r = resolve(model, adapters=("all",))
    src = r.adapters["all"].path
    rooted = convert_adapter(src, tmp_path / "rooted", "peft3d", hf_config(r.spec), disk_root=root).path
    assert any(k.startswith(f"base_model.model.{root}.") for k in load_file(str(Path(rooted) / WEIGHTS_NAME)))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    adapters = {"text": AdapterSpec("text", str(src)), "rooted": AdapterSpec("rooted", str(rooted))}
    with open_engine("hf", EngineConfig(r.spec, adapters, dtype="float32", device="cpu")) as eng:
        base, text, got = (eng.prompt_logprobs(prompts, a)[0].logprobs for a in (None, "text", "rooted"))
    assert np.abs(text - base).max() > 1e-3, "the adapter does not move the logprobs: the test tests nothing"
    np.testing.assert_array_equal(got, text)
