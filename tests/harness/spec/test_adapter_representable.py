"""generate_adapter's ``representable_in``: every stored A and B is exactly a value of that dtype (a bf16 engine that
casts the file's fp32 tensors to bf16 holds what the fp32 reference reads), it is the unrounded adapter rounded
(same seeds, same sizes), and without it the recipe, and so the content hash of every adapter written before, is as
it was. Tiny random models from tests/helpers/adapters.py; the Embedding LoRA (lm_head / embed_tokens) included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lpdiff.harness.spec import adapters as ad
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import dir_hash
from tests.helpers.adapters import R, tiny_model

GROUPS = ("attention", "experts", "lm_head", "embed_tokens")


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def _not_bf16(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, t in tensors.items() if not torch.equal(t.to(torch.bfloat16).to(t.dtype), t)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_representable_in_bf16_rounds_every_factor_and_only_rounds(arch, tmp_path):
    model = tiny_model(arch)
    kw = dict(groups=GROUPS, rank=R, alpha=8, seed=3)
    plain = _tensors(ad.generate_adapter(model, tmp_path / "plain", **kw).path)
    rounded = _tensors(ad.generate_adapter(model, tmp_path / "bf16", representable_in=torch.bfloat16, **kw).path)
    assert set(rounded) == set(plain) and any("embedding" in k for k in rounded)
    assert all(t.dtype == torch.float32 for t in rounded.values())  # the file's dtype is still `dtype`
    # the fp32 adapter is not bf16-representable (so the check below can fail), the rounded one is, everywhere
    assert _not_bf16(plain)
    assert _not_bf16(rounded) == []
    for k, t in plain.items():  # the same adapter, rounded to nearest bf16: nothing else changed
        assert torch.equal(rounded[k], t.to(torch.bfloat16).to(torch.float32)), k


def test_recipe_names_the_rounding_only_when_asked(tmp_path):
    model = tiny_model("qwen3_moe")
    plain = ad.generate_adapter(model, tmp_path / "plain", rank=R, seed=1)
    rounded = ad.generate_adapter(model, tmp_path / "bf16", rank=R, seed=1, representable_in=torch.bfloat16)
    recipe = [json.loads((Path(a.path) / ad.PROVENANCE_NAME).read_text())["generated"] for a in (plain, rounded)]
    assert "representable_in" not in recipe[0]  # the committed zoo adapters' recipes (and hashes) unchanged
    assert recipe[1]["representable_in"] == "bfloat16"
    assert dir_hash(plain.path) != dir_hash(rounded.path)


def test_representable_in_an_integer_dtype_is_refused(tmp_path):
    with pytest.raises(InputError, match="floating-point"):
        ad.generate_adapter(tiny_model("qwen3_moe"), tmp_path / "a", rank=R, representable_in=torch.int8)
