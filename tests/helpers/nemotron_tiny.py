"""A tiny Nemotron-3 Super for CPU tests: the catalog's Super config narrowed in width (tests/helpers/configs.py), its
first ``layers`` layers of the hybrid pattern (8: MEMEMEM*, three latent MoE layers), SSD chunks of 16 tokens so
that short prompts cross them, a wide initializer so that adapters move logprobs far above 1e-4, and a random router
correction bias (random init leaves it zero; a real one makes the biased choice matter)."""

from __future__ import annotations

import torch


def tiny_super(layers: int = 8, seed: int = 0):
    """-> the HF model (fp32, eval) and its config kwargs (``vocab_size`` among them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.configs import narrow_full_config

    kw = narrow_full_config("nemotron-3-super-120b-a12b")
    kw.update(
        num_hidden_layers=layers,
        hybrid_override_pattern=kw["hybrid_override_pattern"][:layers],
        initializer_range=0.15,
        chunk_size=16,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "moe":
                layer.mixer.gate.e_score_correction_bias.normal_(0, 0.05)
    return model, kw
