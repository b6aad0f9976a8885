"""The supported archs by name. Two kinds:

- MoE transformers (qwen3_moe.py, gpt_oss.py): the module fills config.ModelConfig from the HF config and says how
  its expert weights map to the kernels' layout; the shared MoeTransformer (model.py) runs them.
- Archs whose module owns the whole model (``HYBRIDS``: hybrids whose mixers the shared decoder does not have).
  Such a module defines ``build(hf_config, source, adapters, shard, dtype, device, all_reduce, options) -> Built``;
  runtime.Runtime calls it instead of model_config / load_weights / stack_adapters / MoeTransformer. It is imported
  only when a model of its arch is opened (lazily: it may import lora.py / weights.py, which import this file).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import lpdiff.engines.triton.gpt_oss as gpt_oss
import lpdiff.engines.triton.qwen3_moe as qwen3_moe
from lpdiff.engines.triton.config import SUPPORTED_ARCHS, ModelConfig

ARCHS: dict[str, ModuleType] = {"qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss}
# arch (the checkpoint's model type, engines.capabilities.model_type) -> the module that builds the whole model
HYBRIDS: dict[str, str] = {
    "qwen3_5_moe": "lpdiff.engines.triton.qwen3_5",
    "nemotron_h": "lpdiff.engines.triton.nemotron_h",
}
assert set(ARCHS) | set(HYBRIDS) == set(SUPPORTED_ARCHS), "config.SUPPORTED_ARCHS names the archs this file maps"


@dataclass(slots=True)
class Built:
    """What a hybrid module's ``build`` hands the runtime.

    cfg: its own config; Batch.build reads ``rope_inv_freq`` (rotary_dim // 2,) float32 and
      ``rope_attention_scaling``, the engine ``vocab_size``, and ``arch`` names it.
    weights: anything with ``lm_head`` (V, H) and ``nbytes()``.
    lora: None or an object with ``slot(name) -> int`` (-1 for None), ``names`` and ``nbytes()``
      (lora.StackedLora does).
    model: ``forward(batch) -> (final-normed hidden (T, H), smallest router margin per token (T,) float32)``, and a
      ``capture`` attribute (None, or a dict the forward fills with layer index -> that layer's output hidden
      states, for lpdiff bisect). Optional ``capture_modules(batch, inputs) -> {(layer, point): tensor}`` re-runs
      its modules on another engine's inputs (capture.py); without it a module-level capture is refused.
    """

    cfg: object
    weights: object
    lora: object | None
    model: object


def arch_name(hf_config) -> str | None:
    """The arch a transformers config names, as the registry keys it: a multimodal checkpoint's text model
    (``qwen3_5_moe_text``) is its checkpoint's arch (``qwen3_5_moe``)."""
    arch = getattr(hf_config, "model_type", None)
    return None if arch is None else arch.removesuffix("_text")


def arch_module(arch: str) -> ModuleType:
    if arch in HYBRIDS:
        return importlib.import_module(HYBRIDS[arch])
    return ARCHS[arch]


def hybrid_module(hf_config) -> ModuleType | None:
    """The module that builds this whole model (its ``build`` hook), or None for the shared MoeTransformer."""
    arch = arch_name(hf_config)
    return arch_module(arch) if arch in HYBRIDS else None


def model_config(hf_config, num_layers: int | None = None) -> ModelConfig:
    """Normalise a transformers config (optionally reduced to ``num_layers``) for the arch it names."""
    arch = getattr(hf_config, "model_type", None)
    if arch not in ARCHS:
        hybrid = arch_name(hf_config)
        if hybrid in HYBRIDS:
            raise ValueError(
                f"arch {arch!r} is built by its own module ({HYBRIDS[hybrid]}.build), not from a ModelConfig"
            )
        raise ValueError(
            f"the triton engine does not support arch {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHS)} (use engine 'hf' for other models)"
        )
    cfg = ARCHS[arch].config_from_hf(hf_config)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers={num_layers} but the model has {cfg.num_layers} layers")
        cfg.num_layers = num_layers
        cfg.sliding_windows = cfg.sliding_windows[:num_layers]
    return cfg
