"""One baseline = one parquet file: a row per prompt (token ids, logprobs, top-k ids / logprobs and router margins
as list columns) and the manifest (key, what was computed, provenance) as JSON in the file's key-value metadata.

One file makes a baseline one unit: it is renamed into place whole, so a reader sees the old file or the new one,
never a data file beside another run's description. Plain parquet, so ``datasets.load_dataset("parquet", ...)``
and the Hub's dataset viewer read it; the per-row ``baseline`` / ``model`` / ``adapter`` / ``engine`` / ``dtype``
columns let one dataset hold many baselines and still be filtered.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lpdiff.harness.pipeline.store_errors import BaselineCorrupt
from lpdiff.harness.types import LogprobRun

FORMAT = 2
META_KEY = b"lpdiff.manifest"
SUFFIX = ".parquet"


def _list(t: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("element", t))  # parquet's own name for list items: what a reader sees anyway


SCHEMA = pa.schema(
    [
        ("baseline", pa.string()),
        ("model", pa.string()),
        ("adapter", pa.string()),
        ("engine", pa.string()),
        ("dtype", pa.string()),
        ("prompt", pa.int32()),
        ("token_ids", _list(pa.int64())),
        ("logprobs", _list(pa.float32())),
        ("topk_ids", _list(_list(pa.int64()))),
        ("topk_logprobs", _list(_list(pa.float32()))),
        ("router_margin", _list(pa.float32())),
    ]
)


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """Checksum of the manifest itself (without this field), so that damage to the provenance is seen too."""
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def data_sha256(run: LogprobRun) -> str:
    """Checksum of the numbers (names, dtypes, shapes and bytes of the flattened arrays in a fixed order): a file
    edited or damaged in a way parquet itself accepts still fails it."""
    h = hashlib.sha256()
    for name, arr in sorted(run.to_arrays().items()):
        arr = np.ascontiguousarray(arr)
        h.update(f"{name}:{arr.dtype.str}:{arr.shape}\0".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def _lists(flat: np.ndarray, lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=typ.value_type))


def _nested(flat: np.ndarray, pos_lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    """(positions, k) rows grouped per prompt: list<list<T>>."""
    k = flat.shape[1]
    inner = _lists(flat.reshape(-1), np.full(flat.shape[0], k), typ.value_type)
    offsets = np.concatenate([[0], np.cumsum(pos_lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), inner)


def encode(run: LogprobRun, manifest: dict[str, Any]) -> pa.Table:
    arrays = run.to_arrays()
    lens = arrays["lengths"]
    n = len(lens)
    names = manifest.get("names", {})
    per_row = {
        "baseline": manifest.get("digest"),
        "model": names.get("model"),
        "adapter": names.get("adapter"),
        "engine": manifest.get("key", {}).get("engine"),
        "dtype": manifest.get("key", {}).get("dtype"),
    }
    cols: dict[str, pa.Array] = {c: pa.array([v] * n, type=pa.string()) for c, v in per_row.items()}
    cols["prompt"] = pa.array(np.arange(n, dtype=np.int32))
    cols["token_ids"] = _lists(arrays["token_ids"], lens, SCHEMA.field("token_ids").type)
    cols["logprobs"] = _lists(arrays["logprobs"], lens - 1, SCHEMA.field("logprobs").type)
    for name in ("topk_ids", "topk_logprobs"):
        typ = SCHEMA.field(name).type
        cols[name] = _nested(arrays[name], lens - 1, typ) if name in arrays else pa.nulls(n, type=typ)
    typ = SCHEMA.field("router_margin").type
    cols["router_margin"] = (
        _lists(arrays["router_margin"], lens, typ) if "router_margin" in arrays else pa.nulls(n, type=typ)
    )
    manifest = {**manifest, "manifest_sha256": manifest_sha256(manifest)}
    meta = {META_KEY: json.dumps(manifest, sort_keys=True, default=str).encode()}
    return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA.with_metadata(meta))


def write(table: pa.Table, fh: BinaryIO) -> None:
    # store_schema=False: no second (base64) copy of the schema and manifest, whose damage nothing would notice;
    # the manifest goes into the file's own key-value metadata instead
    with pq.ParquetWriter(fh, SCHEMA, compression="zstd", write_page_checksum=True, store_schema=False) as w:
        w.write_table(table.replace_schema_metadata(None))
        w.add_key_value_metadata(table.schema.metadata)


def _flat(col: pa.ChunkedArray, dtype) -> np.ndarray:
    return np.asarray(pa.concat_arrays(col.chunks).flatten().to_numpy(zero_copy_only=False), dtype=dtype)


def _optional(table: pa.Table, name: str, dtype, nested: bool) -> np.ndarray | None:
    col = table.column(name)
    if col.null_count == len(col):
        return None
    if col.null_count:
        raise ValueError(f"column {name} is null for some prompts only")
    if not nested:
        return _flat(col, dtype)
    inner = pa.concat_arrays(col.chunks).flatten()
    widths = set(np.asarray(inner.value_lengths()).tolist())
    if len(widths) > 1:
        raise ValueError(f"column {name} has rows of different widths {sorted(widths)}")
    k = widths.pop() if widths else 0
    return np.asarray(inner.flatten().to_numpy(zero_copy_only=False), dtype=dtype).reshape(-1, k)


def _manifest(kv: dict[bytes, bytes] | None) -> dict[str, Any]:
    manifest = json.loads((kv or {})[META_KEY])
    if manifest.get("manifest_sha256") != manifest_sha256(manifest):
        raise ValueError("the manifest fails its checksum")
    return manifest


def _unreadable(path, e: Exception) -> BaselineCorrupt:
    why = " ".join(str(e).split())[:200]  # pyarrow's messages span lines; the CLI prints one
    return BaselineCorrupt(f"baseline {path} is not a readable lpdiff baseline ({type(e).__name__}: {why})")


def read(path, data: bytes | None = None) -> tuple[LogprobRun, dict[str, Any]]:
    """(run, manifest) of a baseline file (``data``: its bytes, already read; ``path`` then only names it);
    BaselineCorrupt naming ``path`` when it is not one (unreadable, junk, truncated, or its numbers fail their
    checksum)."""
    try:
        with pq.ParquetFile(path if data is None else pa.BufferReader(data), page_checksum_verification=True) as pf:
            table = pf.read()
            manifest = _manifest(pf.metadata.metadata)
        if not table.schema.equals(SCHEMA, check_metadata=False):
            raise ValueError(f"columns {table.schema.names} are not those of format {FORMAT}")
        lens = np.asarray(table.column("token_ids").combine_chunks().value_lengths(), dtype=np.int64)
        arrays = {
            "lengths": lens,
            "token_ids": _flat(table.column("token_ids"), np.int64),
            "logprobs": _flat(table.column("logprobs"), np.float32),
        }
        for name, dtype, nested in (
            ("topk_ids", np.int64, True),
            ("topk_logprobs", np.float32, True),
            ("router_margin", np.float32, False),
        ):
            arr = _optional(table, name, dtype, nested)
            if arr is not None:
                arrays[name] = arr
        run = LogprobRun.from_arrays(arrays, manifest.get("meta", {}))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AssertionError, pa.ArrowException) as e:
        raise _unreadable(path, e) from None
    if manifest.get("format") != FORMAT:
        raise BaselineCorrupt(
            f"baseline {path} has format {manifest.get('format')!r}; this lpdiff reads format {FORMAT}"
        )
    if data_sha256(run) != manifest.get("data_sha256"):
        raise BaselineCorrupt(f"baseline {path} fails its checksum (the file was damaged or edited)")
    return run, manifest


def read_manifest(path) -> dict[str, Any]:
    """The manifest alone (the footer; no data pages are read): what ``ls`` and the stale rule need."""
    try:
        return _manifest(pq.read_metadata(path).metadata)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
        raise _unreadable(path, e) from None
