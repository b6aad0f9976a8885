"""A real checkpoint cut to its first n layers without reading the dropped layers: the safetensors headers are
parsed here and only the kept tensors' byte ranges are copied (no decoding, so any dtype, FP8 and MXFP4 blocks
included, travels as it is). The copy lives under ``cache_root()/cut/<identity hash>`` and is written once.

The config is cut in its own JSON (not through transformers), so the Hub's spelling (``hybrid_override_pattern``,
``text_config`` nesting) survives for engines that pin other transformers versions.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, BinaryIO

from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.types import canonical_hash

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # decoder layer index in a tensor name (mtp.layers.* included)
_PER_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types")
_NESTED = ("text_config", "llm_config", "language_config")
_CHUNK = 16 << 20
INDEX = "model.safetensors.index.json"


def _read(fh: BinaryIO, offset: int, size: int) -> bytes:
    """Every byte taken from a source shard is read here (tests record the ranges)."""
    fh.seek(offset)
    data = fh.read(size)
    if len(data) != size:
        raise SpecError(f"{fh.name} is truncated: wanted {size} bytes at {offset}, got {len(data)}")
    return data


def cut_config(config: dict[str, Any], n: int | None) -> dict[str, Any]:
    """The config.json of the first ``n`` layers (a copy; ``n`` None: uncut): num_hidden_layers, per-layer lists and
    Nemotron's hybrid_override_pattern, at the top level and in a nested text config."""
    config = copy.deepcopy(config)
    if n is None:
        return config
    found = False
    for d in [config, *(config[k] for k in _NESTED if isinstance(config.get(k), dict))]:
        pattern = d.get("hybrid_override_pattern")
        old = d.get("num_hidden_layers") or (len(pattern) if isinstance(pattern, str) else None)
        if old is None:
            continue
        found = True
        if n > old:
            raise SpecError(f"--num-layers {n} but the model has only {old} layers; pass --num-layers <= {old}")
        for k in _PER_LAYER_LISTS:
            if isinstance(d.get(k), list) and len(d[k]) == old:
                d[k] = d[k][:n]
        if isinstance(pattern, str):
            d["hybrid_override_pattern"] = pattern[:n]
        if isinstance(d.get("mlp_only_layers"), list):
            d["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < n]
        if "num_hidden_layers" in d:
            d["num_hidden_layers"] = n
        if isinstance(d.get("max_window_layers"), int):
            d["max_window_layers"] = min(d["max_window_layers"], n)
    if not found:
        raise SpecError("config.json has no num_hidden_layers; --num-layers cannot cut this model")
    return config


def kept(name: str, n: int) -> bool:
    m = LAYER.search(name)
    return m is None or name.startswith("mtp.") or int(m.group(1)) < n


def _header(fh: BinaryIO) -> tuple[dict[str, Any], int]:
    (size,) = struct.unpack("<Q", _read(fh, 0, 8))
    if size > 100 << 20:
        raise SpecError(f"{fh.name}: safetensors header of {size} bytes; not a safetensors file")
    return json.loads(_read(fh, 8, size)), 8 + size


def cut_shard(src: Path, dst: Path, n: int) -> int:
    """Write the kept tensors of one safetensors file to ``dst``; returns their byte count (0: nothing kept, no
    file written)."""
    with open(src, "rb") as fh:
        header, base = _header(fh)
        meta = header.pop("__metadata__", None)
        names = sorted((k for k in header if kept(k, n)), key=lambda k: header[k]["data_offsets"][0])
        if not names:
            return 0
        out_header: dict[str, Any] = {"__metadata__": meta} if meta else {}
        pos = 0
        for k in names:
            b, e = header[k]["data_offsets"]
            out_header[k] = {**header[k], "data_offsets": [pos, pos + e - b]}
            pos += e - b
        blob = json.dumps(out_header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the header is padded to 8 bytes, as safetensors writes it
        with open(dst, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            for k in names:
                b, e = header[k]["data_offsets"]
                out.writelines(_read(fh, base + off, min(_CHUNK, e - off)) for off in range(b, e, _CHUNK))
        return pos


def cut_checkpoint(src: Path, n: int, identity: dict[str, Any], root: Path) -> Path:
    """``src`` cut to ``n`` layers, under ``root`` keyed by ``identity`` (the source's) and ``n``; reused when
    already there, so the source is read once."""
    out = root / "cut" / canonical_hash({"source": identity, "num_layers": n})[:20]
    if (out / "config.json").is_file():
        return out
    config = cut_config(json.loads((src / "config.json").read_text()), n)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        index = src / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        else:
            weight_map, shards = None, sorted(p.name for p in src.glob("*.safetensors"))
        total, written = 0, set()
        for s in shards:
            size = cut_shard(src / s, tmp / s, n)
            total += size
            if size:
                written.add(s)
        if weight_map is not None:
            kept_map = {k: v for k, v in weight_map.items() if kept(k, n) and v in written}
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": kept_map}, indent=2, sort_keys=True)
            )
        for f in src.iterdir():  # tokenizer, generation config, chat template...; never pickles
            if (
                f.is_file()
                and f.name not in ("config.json", INDEX)
                and f.suffix not in (".safetensors", ".bin", ".pt", ".pth", ".pkl")
            ):
                shutil.copyfile(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        try:
            tmp.rename(out)
        except OSError:  # another process cut it first: the same bytes
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
