"""pipeline/doctor_inputs.py: the adapter doctor reads is resolved as ``lpdiff run --adapter`` resolves it, and an
adapter whose every lora_B is zero (PEFT's untrained default) is one error finding; a trained one gives none."""

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lpdiff.harness.pipeline.doctor_facts import gather
from lpdiff.harness.pipeline.doctor_inputs import check_noop, resolve_adapter
from lpdiff.harness.spec.catalog import get_model
from tests.helpers.paths import REPO

MODEL = "tiny-qwen3-moe"
ZOO = REPO / "harness" / "zoo_adapters" / MODEL


def test_a_directory_is_taken_as_given_and_a_zoo_name_is_resolved(tmp_path):
    assert resolve_adapter(MODEL, tmp_path) == str(tmp_path)
    assert Path(resolve_adapter(MODEL, "experts")).resolve() == (ZOO / "experts").resolve()


def test_an_all_zero_lora_b_is_a_no_op_finding(tmp_path):
    src = ZOO / "all"
    dst = tmp_path / "noop"
    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    assert any(bool(t.any()) for k, t in tensors.items() if ".lora_B" in k)
    save_file(
        {k: torch.zeros_like(t) if ".lora_B" in k else t for k, t in tensors.items()}, dst / "adapter_model.safetensors"
    )
    found = check_noop(gather(get_model(MODEL), dst))
    assert [(f.severity, f.code) for f in found] == [("error", "adapter-no-op")]
    assert "init_lora_weights=False" in found[0].fix
    assert check_noop(gather(get_model(MODEL), src)) == []


def test_without_a_weights_file_there_is_nothing_to_say(tmp_path):
    """The validation layer names a missing weights file; the no-op check does not guess."""
    facts = gather(get_model(MODEL), ZOO / "all")
    facts = dataclasses.replace(facts, info=dataclasses.replace(facts.info, path=str(tmp_path)))
    assert check_noop(facts) == []
