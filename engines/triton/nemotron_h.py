"""Nemotron-H (Nemotron-3 Nano 30B-A3B, Super 120B-A12B) in the triton runtime: the arch module archs.HYBRIDS names,
whose ``build`` hook hands runtime.Runtime the whole model (config, weights and LoRA: nemotron_h_weights.py; the
forward: nemotron_h_model.py, with the Mamba-2 mixer in mamba.py and its sequence ops in kernels/ssd.py)."""

from __future__ import annotations

import torch

from lpdiff.engines.triton.archs import Built
from lpdiff.engines.triton.nemotron_h_model import NemotronHModel
from lpdiff.engines.triton.nemotron_h_weights import Names, config_from_hf, load, stack_adapters
from lpdiff.engines.triton.shard import Shard

EMBEDDING_LORA = True  # the model adds the runtime's embedding LoRA (vocab_lora.VocabLora) to the embedded tokens


def build(hf, source, adapters: dict, shard: Shard, dtype: torch.dtype, device: torch.device, all_reduce, options):
    """archs.Built for a Nemotron-H model (runtime.Runtime calls it)."""
    cfg = config_from_hf(hf)
    weights = load(cfg, Names(source, dtype, device), shard)
    lora = stack_adapters(cfg, weights, adapters, shard, dtype, device)
    model = NemotronHModel(
        cfg, weights, lora, shard, all_reduce, options.impl, options.attention, options.moe_backend, options.mamba_scan
    )
    return Built(cfg, weights, lora, model)
