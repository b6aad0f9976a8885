"""--num-layers on a real checkpoint directory: the cut copy is read without touching the dropped layers (every byte
read is recorded, and the dropped tensors are corrupted in the test's copy), holds the Hub's config spelling cut to
depth, and computes what the engines' own cut of the full checkpoint computes."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from lpdiff.harness.spec import cut
from lpdiff.harness.spec.catalog import ZOO_DIR, get_model, load_hf_model
from lpdiff.harness.spec.resolve import SpecError, resolve_model
from lpdiff.harness.types import dir_hash
from tests.helpers.hf_cache import offline_home


def _dropped_ranges(path, n):
    """Absolute byte ranges of the tensors of layers >= n in a safetensors file."""
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return [
        (8 + size + b, 8 + size + e) for k, v in header.items() if not cut.kept(k, n) for b, e in [v["data_offsets"]]
    ]


@pytest.mark.parametrize("model, n", [("tiny-qwen3-moe", 2), ("tiny-nemotron-h", 3)])
def test_cut_never_reads_dropped_layers(monkeypatch, tmp_path, model, n):
    offline_home(monkeypatch, tmp_path)
    d = tmp_path / "ckpt"
    shutil.copytree(ZOO_DIR / model, d)
    weights = d / "model.safetensors"
    dropped = _dropped_ranges(weights, n)
    assert dropped
    with open(weights, "r+b") as fh:  # the dropped layers become NaN: reading them would poison the model
        for b, e in dropped:
            fh.seek(b)
            fh.write(b"\xff" * (e - b))
    reads = []
    real_read = cut._read

    def recording(fh, offset, size):
        reads.append((fh.name, offset, offset + size))
        return real_read(fh, offset, size)

    monkeypatch.setattr(cut, "_read", recording)
    spec = resolve_model(str(d), num_layers=n)
    assert reads and all(e <= b0 or s >= e0 for _, s, e in reads for b0, e0 in dropped), "read a dropped layer"
    assert spec.num_layers is None and spec.path != str(d)
    # keyed as the engines' own cut of the full checkpoint is: its content hash + depth
    assert spec.identity() == {**get_model(model, num_layers=n).identity(), "weights": dir_hash(d)}
    config = json.loads((cut.Path(spec.path) / "config.json").read_text())
    assert config["num_hidden_layers"] == n
    if "hybrid_override_pattern" in config:  # Nemotron keeps the Hub's spelling, cut
        full = json.loads((ZOO_DIR / model / "config.json").read_text())
        assert config["hybrid_override_pattern"] == full["hybrid_override_pattern"][:n]
        assert len(config["layers_block_type"]) == n
    ids = torch.tensor([[5, 17, 300, 42, 9, 801, 3]])
    with torch.no_grad():
        got = load_hf_model(spec, torch.float32, "cpu")(ids).logits
        want = load_hf_model(get_model(model, num_layers=n), torch.float32, "cpu")(ids).logits
    assert torch.isfinite(got).all() and torch.equal(got, want)
    reads.clear()
    assert resolve_model(str(d), num_layers=n).path == spec.path and not reads  # cut once, then reused


def test_cut_config_nested_and_too_deep():
    cfg = {
        "model_type": "qwen3_5_moe",
        "text_config": {"num_hidden_layers": 4, "mrope_section": [1, 1, 2, 0], "layer_types": ["l", "l", "l", "f"]},
    }
    out = cut.cut_config(cfg, 2)
    assert out["text_config"]["num_hidden_layers"] == 2 and out["text_config"]["layer_types"] == ["l", "l"]
    assert out["text_config"]["mrope_section"] == [1, 1, 2, 0]  # not a per-layer list: untouched
    with pytest.raises(SpecError, match="only 4 layers"):
        cut.cut_config(cfg, 5)


def test_sharded_checkpoint_index_is_cut(tmp_path):
    """A checkpoint in shards + model.safetensors.index.json: shards holding only dropped layers are not written,
    the index lists exactly the kept tensors."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "x", "num_hidden_layers": 3}))
    shards = {
        "a.safetensors": {"model.embed.weight": torch.ones(2, 2), "model.layers.0.w": torch.arange(4.0)},
        "b.safetensors": {"model.layers.1.w": torch.full((3,), 2.0), "model.layers.2.w": torch.zeros(5)},
        "c.safetensors": {"model.layers.2.v": torch.zeros(1, dtype=torch.bfloat16)},
    }
    for name, tensors in shards.items():
        save_file(tensors, str(src / name))
    (src / cut.INDEX).write_text(json.dumps({"weight_map": {k: f for f, t in shards.items() for k in t}}))
    out = cut.cut_checkpoint(src, 2, {"weights": "test"}, tmp_path / "cache")
    index = json.loads((out / cut.INDEX).read_text())["weight_map"]
    assert index == {
        "model.embed.weight": "a.safetensors",
        "model.layers.0.w": "a.safetensors",
        "model.layers.1.w": "b.safetensors",
    }
    assert not (out / "c.safetensors").exists()
    assert torch.equal(load_file(str(out / "b.safetensors"))["model.layers.1.w"], torch.full((3,), 2.0))
    assert torch.equal(load_file(str(out / "a.safetensors"))["model.layers.0.w"], torch.arange(4.0))
