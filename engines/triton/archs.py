"""The supported archs by name: each one's module (qwen3_moe.py, gpt_oss.py) fills config.ModelConfig from the HF
config and says how its expert weights map to the kernels' layout."""
from __future__ import annotations

from types import ModuleType

import lpdiff.engines.triton.gpt_oss as gpt_oss
import lpdiff.engines.triton.qwen3_moe as qwen3_moe
from lpdiff.engines.triton.config import SUPPORTED_ARCHS, ModelConfig

ARCHS: dict[str, ModuleType] = {"qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss}
assert tuple(ARCHS) == SUPPORTED_ARCHS, "config.SUPPORTED_ARCHS names the archs this file maps"


def arch_module(arch: str) -> ModuleType:
    return ARCHS[arch]


def model_config(hf_config, num_layers: int | None = None) -> ModelConfig:
    """Normalise a transformers config (optionally reduced to ``num_layers``) for the arch it names."""
    arch = getattr(hf_config, "model_type", None)
    if arch not in ARCHS:
        raise ValueError(f"the triton engine does not support arch {arch!r}; supported: {', '.join(ARCHS)} "
                         "(use engine 'hf' for other models)")
    cfg = ARCHS[arch].config_from_hf(hf_config)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers={num_layers} but the model has {cfg.num_layers} layers")
        cfg.num_layers = num_layers
        cfg.sliding_windows = cfg.sliding_windows[:num_layers]
    return cfg
