"""The PEFT adapter directory on disk: its config, tensors and lpdiff's provenance file, read and written so that
the bytes are stable (adapter directories are content-hashed into baseline keys)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from lpdiff.harness.spec.errors import InputError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PROVENANCE_NAME = "lpdiff_adapter.json"  # how lpdiff made this directory (generator recipe, conversions)


def read_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise InputError(f"{adapter_dir} has no {CONFIG_NAME}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{adapter_dir} is a {cfg['peft_type']} adapter; lpdiff handles LORA only")
    for flag in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if cfg.get(flag):
            raise InputError(f"{adapter_dir}: {flag}=true is not supported (plain LoRA only)")
    return cfg


def peft_signature(adapter_dir: str | Path) -> str:
    """What decides whether PEFT can hold adapters side by side: one PeftModel takes several adapters only when
    they spell ``target_parameters`` the same way (NOTES.md); equal signatures can share one."""
    return f"|{sorted(read_config(Path(adapter_dir)).get('target_parameters') or [])}"


def load_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = adapter_dir / WEIGHTS_NAME
    if not path.is_file():
        raise InputError(f"{adapter_dir} has no {WEIGHTS_NAME} (lpdiff reads safetensors adapters only)")
    return load_file(str(path))


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it (os.umask would, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """``safetensors.torch.save_file`` with the permissions any other written file gets (0666 minus the umask):
    safetensors 0.8 creates its files 0600, so an adapter shared with a group or a CI user could not be read."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def respect_umask(folder: str | Path) -> None:
    """Give every file a library wrote into ``folder`` (PEFT's save_pretrained -> safetensors: 0600) the mode 0666
    minus the umask."""
    mode = 0o666 & ~_umask()
    for p in Path(folder).iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


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
