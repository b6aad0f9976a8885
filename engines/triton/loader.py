"""Weight sources: tensors by their in-memory transformers name, taken once (the source drops its reference so
that converting layer by layer never holds two copies of the model).

- ``CheckpointSource``: an HF checkpoint directory (one ``model.safetensors`` or a sharded index), expert weights
  either fused (``mlp.experts.gate_up_proj``) or per expert (``mlp.experts.{e}.gate_proj.weight``, Qwen's on-disk
  layout), read straight to the target device.
- ``StateDictSource``: a live model's state dict (config-built models: the seeded HF model built on the device).
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import torch

from lpdiff.harness.spec.catalog import hf_config, load_hf_model

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class StateDictSource:
    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.sd = dict(state_dict)

    def take(self, name: str) -> torch.Tensor:
        try:
            return self.sd.pop(name)
        except KeyError:
            raise KeyError(f"weight {name!r} missing from the model's state dict") from None

    def has(self, name: str) -> bool:
        return name in self.sd


class CheckpointSource:
    def __init__(self, path: str | Path, device: torch.device):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors in {self.path}; the triton engine reads safetensors "
                    "checkpoints only (re-save a .bin checkpoint with save_pretrained)"
                )
            weight_map = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    weight_map.update(dict.fromkeys(h.keys(), f.name))
        if any(k.endswith(("_blocks", "_scales")) for k in weight_map):
            raise ValueError(
                f"{self.path} holds MXFP4-quantised experts (*_blocks/*_scales); the triton engine "
                "needs a bf16 checkpoint (dequantise with transformers and save_pretrained)"
            )
        dev = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
        self.handles = {f: safe_open(self.path / f, framework="pt", device=dev) for f in set(weight_map.values())}
        self.weight_map = weight_map

    def has(self, name: str) -> bool:
        return name in self.weight_map or self._per_expert_keys(name) is not None

    def _load(self, name: str) -> torch.Tensor:
        return self.handles[self.weight_map[name]].get_tensor(name)

    def _per_expert_keys(self, name: str) -> list[list[str]] | None:
        """Names of the per-expert tensors that make up a fused expert parameter, or None."""
        m = _PER_EXPERT.match(name)
        if m is None:
            return None
        base, param = m.groups()
        parts = ["gate_proj", "up_proj"] if param == "gate_up_proj" else ["down_proj"]
        keys: list[list[str]] = []
        while all(f"{base}.{len(keys)}.{p}.weight" in self.weight_map for p in parts):
            keys.append([f"{base}.{len(keys)}.{p}.weight" for p in parts])
        return keys or None

    def take(self, name: str) -> torch.Tensor:
        if name in self.weight_map:
            return self._load(name)
        keys = self._per_expert_keys(name)
        if keys is None:
            raise KeyError(f"weight {name!r} not found in checkpoint {self.path}")
        # gate rows then up rows per expert: the fused layout transformers builds on load
        return torch.stack([torch.cat([self._load(k) for k in ks], dim=0) for ks in keys])


def open_source(spec, dtype: torch.dtype, device: torch.device):
    """-> (hf_config, source). Config-built specs build the seeded HF model on the device (the same recipe the
    reference engine uses, so both see identical weights) and hand over its tensors."""
    if spec.path is not None:
        return hf_config(spec), CheckpointSource(spec.path, device)

    model = load_hf_model(spec, dtype, device)
    hf = model.config
    source = StateDictSource(model.state_dict())
    del model
    gc.collect()  # the module graph has cycles: free it now so taken tensors are the only references left
    return hf, source
