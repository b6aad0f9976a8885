"""A deterministic random LoRA adapter for a model, written by PEFT's own save_pretrained."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lpdiff.harness.spec.adapters.convert import convert_adapter
from lpdiff.harness.spec.adapters.files import CONFIG_NAME, PROVENANCE_NAME, respect_umask, write_json
from lpdiff.harness.spec.adapters.layout import LAYOUTS, ModelLayout, resolve_targets
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import AdapterSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GENERATOR_VERSION = "lpdiff-adapter-gen/v1"  # bump when generated values change for the same arguments
DEFAULT_SCALE = 0.2


def _generator(seed: int, *parts: str) -> torch.Generator:
    """A CPU generator per tensor: values depend on (seed, tensor name) only, not on which other groups exist."""
    digest = hashlib.sha256("/".join([str(seed), *parts]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def generate_adapter(
    model: PreTrainedModel,
    out_dir: str | Path,
    groups: Sequence[str] = ("attention", "experts"),
    rank: int = 8,
    alpha: float = 16,
    seed: int = 0,
    scale: float = DEFAULT_SCALE,
    layout: str = "peft3d",
    shared_outer: bool = False,
    use_rslora: bool = False,
    dtype: torch.dtype = torch.float32,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
) -> AdapterSpec:
    """A deterministic random LoRA adapter for `model` (a transformers model with real weights), saved by PEFT's
    own save_pretrained (peft3d) or converted from it (per_expert).

    Every A and B is non-zero. Sizes: A ~ N(0, 1/in), B ~ N(0, c^2) with c chosen so that the RMS of each
    delta scaling * B @ A is `scale` times the RMS of the weight it adapts. The default 0.2 moves the tiny zoo's
    actual-token logprobs by mean |d| 0.17-0.28 (max 1.0-2.5) with every group, 0.07-0.13 (max 0.5-1.0) with
    experts only (docs/zoo.md, "Generated adapter scale"). `shared_outer`: A of gate_up (Nemotron: up) and B of
    down_proj identical across experts (the layout some engines use). The caller's model is not modified: PEFT wraps
    a meta-device copy of it.

    Trainers' forms, through PEFT's own LoraConfig: ``use_rslora`` (scaling alpha/sqrt(r)), ``rank_pattern`` /
    ``alpha_pattern`` (per-module rank and alpha, keyed as PEFT matches them: a regex for a dotted suffix of the
    module path, the parameter path for 3D experts), and the ``lm_head`` / ``embed_tokens`` groups (an Embedding
    LoRA: A (r, vocab) ~ N(0, 1), one row of r values looked up per token, B sized like the others). The file is
    saved with ``save_embedding_layers=False``: PEFT's default ("auto") also stores the base embedding and lm_head
    weights when an embedding is targeted, which adds nothing to the LoRA (lpdiff's reader skips such copies)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer, LoraModel

    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if getattr(model, "peft_config", None) is not None:
        raise ValueError("pass the base transformers model, not a PeftModel")
    assert rank >= 1 and scale > 0
    mlayout = ModelLayout.of(model)
    targets = resolve_targets(mlayout, groups)
    lcfg = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; it scales by alpha / r and saves floats
        use_rslora=use_rslora,
        init_lora_weights=False,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        # [] and not None: PEFT fills None with its default targets for some model types
        # (nemotron_h: q/k/v/o_proj), even when target_parameters are given
        target_modules=list(targets.target_modules),
        target_parameters=list(targets.target_parameters) or None,
        base_model_name_or_path=getattr(model, "name_or_path", None) or None,
    )
    with torch.device("meta"):
        shadow = type(model)._from_config(copy.deepcopy(model.config), dtype=torch.float32)
        peft_model = get_peft_model(shadow, lcfg)
    tuner = cast(LoraModel, peft_model.base_model)  # nn.Module's __getattr__ types it Tensor | Module
    got_modules, got_params = set(tuner.targeted_module_names), set(tuner.targeted_parameter_names)
    if got_modules != set(targets.modules) or got_params != set(targets.params):
        diff = sorted((got_modules | got_params) ^ set(targets.modules + targets.params))[:4]
        raise InputError(
            f"PEFT did not target exactly what groups {list(groups)} name on this "
            f"{mlayout.model_type} model (differences: {diff}); PEFT rewrites gate/up/down_proj "
            "targets to the experts on qwen2-style MoE models: drop the 'mlp'/'shared_expert' group"
        )

    for name, layer in tuner.model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base = re.sub(r"(\.base_layer)+$", "", name)
        pname = getattr(layer, "parameter_name", "weight")
        weight = model.get_parameter(f"{base}.{pname}")
        if weight.is_meta:
            raise ValueError("generate_adapter sizes the adapter from the model's weights; load real weights first")
        w_rms = torch.linalg.vector_norm(weight.detach(), dtype=torch.float32).item() / math.sqrt(weight.numel())
        if w_rms == 0:
            raise InputError(f"{base}.{pname} is all zeros: cannot size a relative delta for it")
        if "default" in getattr(layer, "lora_embedding_A", {}):
            _fill_embedding(
                layer,
                weight,
                w_rms,
                scale,
                _generator(seed, base, pname, "A"),
                _generator(seed, base, pname, "B"),
                dtype,
            )
            continue
        # nn.Linear for both PEFT's Linear LoRA and its 3D-experts ParamWrapper (r * num_experts rows)
        a_mod, b_mod = cast(nn.Linear, layer.lora_A["default"]), cast(nn.Linear, layer.lora_B["default"])
        n_exp = getattr(layer, "num_experts", 1)
        r, (out_f, in_f) = layer.r["default"], (b_mod.weight.shape[0], a_mod.weight.shape[1])
        b_std = scale * w_rms * math.sqrt(in_f) / (layer.scaling["default"] * math.sqrt(r))
        share_a = shared_outer and n_exp > 1 and pname != "down_proj"
        share_b = shared_outer and n_exp > 1 and pname == "down_proj"
        a = torch.randn(1 if share_a else n_exp, r, in_f, generator=_generator(seed, base, pname, "A"))
        b = torch.randn(out_f, r, 1 if share_b else n_exp, generator=_generator(seed, base, pname, "B"))
        a = (a / math.sqrt(in_f)).expand(n_exp, r, in_f).reshape(n_exp * r, in_f)
        b = (b * b_std).expand(out_f, r, n_exp).reshape(out_f, r * n_exp)
        a_mod.weight = nn.Parameter(a.to(dtype).contiguous(), requires_grad=False)
        b_mod.weight = nn.Parameter(b.to(dtype).contiguous(), requires_grad=False)

    out_dir = Path(out_dir)
    recipe = {
        "generator": GENERATOR_VERSION,
        "model_type": mlayout.model_type,
        "groups": list(groups),
        "rank": rank,
        "alpha": alpha,
        "seed": seed,
        "scale": scale,
        "shared_outer": shared_outer,
        "use_rslora": use_rslora,
        "dtype": str(dtype).removeprefix("torch."),
        "layout": layout,
    }
    if rank_pattern or alpha_pattern:  # only when given: older recipes (and their content hashes) stay as they were
        recipe.update(rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}))
    # Written whole beside out_dir, then moved in: a Ctrl-C or a crash leaves no half-written adapter behind
    work = out_dir.parent / f".{out_dir.name}.{os.getpid()}.tmp"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            save_dir = work if layout == "peft3d" else Path(tmp)
            peft_model.save_pretrained(str(save_dir), save_embedding_layers=False)
            write_json(save_dir / CONFIG_NAME, json.loads((save_dir / CONFIG_NAME).read_text()))
            write_json(save_dir / PROVENANCE_NAME, {"generated": recipe})
            if layout == "per_expert":
                convert_adapter(save_dir, work, "per_expert", mlayout)
        respect_umask(work)
        if not out_dir.exists():
            work.rename(out_dir)
        else:  # an existing folder: its files replaced one by one (each rename atomic)
            for p in work.iterdir():
                os.replace(p, out_dir / p.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return AdapterSpec(name=out_dir.name, path=str(out_dir))


def _fill_embedding(
    layer, weight, w_rms: float, scale: float, gen_a: torch.Generator, gen_b: torch.Generator, dtype: torch.dtype
) -> None:
    """PEFT's Embedding LoRA (lora_embedding_A (r, vocab), lora_embedding_B (hidden, r)): a token's delta is
    scaling * B @ A[:, id], so A ~ N(0, 1) and B ~ N(0, c^2) with c chosen like the Linear case (RMS of the delta =
    scale x RMS of the embedding)."""
    a_par, b_par = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]
    r, vocab, hidden = layer.r["default"], weight.shape[0], weight.shape[1]
    b_std = scale * w_rms / (layer.scaling["default"] * math.sqrt(r))
    a = torch.randn(r, vocab, generator=gen_a)
    b = torch.randn(hidden, r, generator=gen_b) * b_std
    assert a_par.shape == a.shape and b_par.shape == b.shape, (a_par.shape, b_par.shape)
    layer.lora_embedding_A["default"] = nn.Parameter(a.to(dtype).contiguous(), requires_grad=False)
    layer.lora_embedding_B["default"] = nn.Parameter(b.to(dtype).contiguous(), requires_grad=False)
