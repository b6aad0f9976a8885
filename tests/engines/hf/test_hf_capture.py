"""engines/hf_capture.py's reading of transformers' decoder layers (which module is a layer's mixer, its MoE, and
whether the MoE has Nemotron-Super's latent projections), on the tiny Super built in memory from the catalog's
config (tests/helpers/configs.py): its pattern's first layers MEMEMEM*. The capture itself runs in
tests/engines/triton/test_nemotron_super_latent.py (bisect names a dropped latent LoRA) and the bisect tests."""

from __future__ import annotations

import torch

from lpdiff.engines.hf_capture import has_latent, layer_modules
from tests.helpers.configs import narrow_full_config


def _model(latent: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = narrow_full_config("nemotron-3-super-120b-a12b")
    kw.update(num_hidden_layers=8, hybrid_override_pattern=kw["hybrid_override_pattern"][:8])
    if not latent:
        kw["moe_latent_size"] = None  # Nano's MoE: transformers puts Identity where Super has the projections
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))


def test_layer_modules_and_latent_on_super_and_without():
    model = _model(latent=True)
    kinds = [layer_modules(layer)[1] if layer_modules(layer)[0] is not None else "moe" for layer in model.model.layers]
    assert kinds == ["mamba", "moe", "mamba", "moe", "mamba", "moe", "mamba", "attention"]
    moes = [layer_modules(layer)[2] for layer in model.model.layers]
    assert [m is not None for m in moes] == [k == "moe" for k in kinds]
    assert all(has_latent(m) for m in moes if m is not None)
    assert not any(has_latent(m) for m in (layer_modules(layer)[2] for layer in _model(False).model.layers) if m)
