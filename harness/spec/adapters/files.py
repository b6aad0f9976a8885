"""The PEFT adapter directory on disk: its config, tensors and lpdiff's provenance file, read and written so that
the bytes are stable (adapter directories are content-hashed into baseline keys)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PROVENANCE_NAME = "lpdiff_adapter.json"  # how lpdiff made this directory (generator recipe, conversions)


def read_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {CONFIG_NAME}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir} is a {cfg['peft_type']} adapter; lpdiff handles LORA only")
    for flag in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ValueError(f"{adapter_dir}: {flag}=true is not supported (plain LoRA only)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{adapter_dir}: rank_pattern/alpha_pattern give modules different scalings, which the "
                         "canonical form does not carry; re-save the adapter with one rank and alpha")
    return cfg


def peft_signature(adapter_dir: str | Path) -> str:
    """What decides whether PEFT can hold adapters side by side: one PeftModel takes several adapters only when
    they spell ``target_parameters`` the same way (NOTES.md); equal signatures can share one."""
    return f"|{sorted(read_config(Path(adapter_dir)).get('target_parameters') or [])}"


def load_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = adapter_dir / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {WEIGHTS_NAME} (lpdiff reads safetensors adapters only)")
    return load_file(str(path))


def write_json(path: Path, obj: dict) -> None:
    """Byte-stable JSON: adapter directories are content-hashed into baseline keys. PEFT saves target_modules
    from a set, whose order changes with PYTHONHASHSEED, so target lists are sorted too."""
    obj = dict(obj)
    if "peft_type" in obj:
        # Loading never needs random init: every LoRA tensor is in the file. With False, PEFT would give random
        # weights to modules the targets also match but the file does not cover (per-expert gate/up/down names
        # also match Qwen3.5's shared expert and Nemotron's dense MLP), silently adding a random adapter.
        obj["init_lora_weights"] = True
    for k in ("target_modules", "target_parameters"):
        if isinstance(obj.get(k), (list, tuple, set)):
            obj[k] = sorted(obj[k])
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_provenance(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / PROVENANCE_NAME
    return json.loads(path.read_text()) if path.is_file() else {}
