"""Writing a model as a checkpoint directory laid out like the Hub repo it stands for: the repo's config.json (cut
to the kept depth), tensors under the real checkpoint's names (transformers' reverse conversion gives per-expert
keys for qwen3_moe / qwen3_5_moe and ``backbone.`` for nemotron_h; a multimodal wrapper's text weights go under
its language-model prefix, its vision tower is written too), sharded with ``model.safetensors.index.json``, so
vLLM, SGLang and transformers load it exactly as they load the real repo.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lpdiff.harness.spec.cut import cut_config
from lpdiff.harness.types import ModelSpec

SHARD_BYTES = 5 * 2**30  # the Hub's Qwen / Nemotron releases use shards of about 4-5 GB

# The language-model prefix of a multimodal wrapper's checkpoint (architecture -> prefix replacing ``model.``).
WRAPPER_PREFIX = {"Qwen3_5MoeForConditionalGeneration": "model.language_model."}


def hub_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The config.json a spec's checkpoint carries: the Hub file (catalog) or the directory's own, cut to depth."""
    if spec.path is not None:
        cfg = json.loads((Path(spec.path) / "config.json").read_text())
    else:
        cfg = spec.config
    return cut_config(cfg, spec.num_layers)


def _set_dtype(cfg: dict[str, Any], dtype: torch.dtype) -> None:
    """Say the written dtype wherever the file says one (engines run ``dtype=auto`` from it)."""
    name = str(dtype).removeprefix("torch.")
    found = False
    for d in (cfg, cfg.get("text_config")):
        for k in ("torch_dtype", "dtype"):
            if isinstance(d, dict) and k in d:
                d[k], found = name, True
    if not found:
        cfg["torch_dtype"] = name


def _vision_weights(cfg: dict[str, Any], seed: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """A wrapper's vision tower, seeded (it never touches text logprobs; engines build it and vLLM requires every
    built parameter to be loaded)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    kw = dict(cfg)
    wrapper = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    with torch.device(device):
        vision = Qwen3_5MoeVisionModel._from_config(wrapper.vision_config, dtype=torch.bfloat16)
    return {f"model.visual.{k}": v.to(dtype) for k, v in vision.state_dict().items()}


def checkpoint_tensors(model, cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` (a transformers causal LM) under the checkpoint names of ``cfg``'s Hub layout."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(model, model.state_dict())
    prefix = WRAPPER_PREFIX.get((cfg.get("architectures") or [""])[0])
    if prefix is None:
        return sd
    out = {(prefix + k[len("model.") :] if k.startswith("model.") else k): v for k, v in sd.items()}
    p = next(iter(sd.values()))
    out.update(_vision_weights(cfg, seed, p.dtype, p.device))
    return out


def write_checkpoint(model, spec: ModelSpec, out: str | Path, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``model`` (built from ``spec``) to ``out`` in the Hub layout: config.json as the repo ships it (cut to
    ``spec.num_layers``, dtype set to the written one), model-0000i-of-0000N.safetensors shards and their index."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    built = getattr(model, "init_report", None)  # set by catalog.load_hf_model on config-built models
    if built is not None and (built["recipe"], built["seed"]) != (spec.init_recipe, spec.init_seed):
        raise ValueError(
            f"write_checkpoint: the model was built with init recipe {built['recipe']} seed "
            f"{built['seed']}, the spec says {spec.init_recipe} seed {spec.init_seed}; engines would "
            "load other weights than the reference: build it with load_hf_model(spec, ...)"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hub_config_dict(spec)
    tensors = checkpoint_tensors(model, cfg, seed=spec.init_seed or 0)
    _set_dtype(cfg, next(iter(tensors.values())).dtype)
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes
    )
    files = split.filename_to_tensors
    if not split.is_sharded:  # always an index, as the Hub repos have
        files = {"model-00001-of-00001.safetensors": next(iter(files.values()))}
    weight_map = {}
    for fname, names in files.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if built is not None:  # the recipe's chosen scales, to compare two machines' builds of one spec
        (out / "lpdiff_init.json").write_text(json.dumps(built, indent=2) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    return out
