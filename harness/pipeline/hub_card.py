"""The dataset card (README.md) of a Hub baseline store (hub.py): the store's entries as a markdown table, with a
``configs`` front matter so that the Hub viewer and ``datasets`` find the parquet files. Entries come from the
parquet files' manifests (only their footers are read) and from JSON sidecars with a ``key``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CARD = "README.md"


def entry_files(root: Path) -> dict[str, Path]:
    """Relative posix path -> file, for every file of a store (dot-files and the card left out)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not any(part.startswith(".") for part in rel.split("/")) and rel != CARD:
            out[rel] = p
    return out


ENTRY_FIELDS = ("model", "adapter", "engine", "dtype", "tp", "prompt_set", "file")


def _entry_from_manifest(m: Mapping[str, Any], rel: str) -> dict[str, Any] | None:
    key, names, meta = m.get("key"), m.get("names") or {}, m.get("meta") or {}
    if not isinstance(key, Mapping):
        return None
    prompts = names.get("prompt_set") or meta.get("prompt_set") or str(key.get("prompts", "-"))[:12]
    return {
        "model": names.get("model") or meta.get("model"),
        "adapter": names.get("adapter") or "-",
        "engine": key.get("engine"),
        "dtype": key.get("dtype"),
        "tp": key.get("tp"),
        "prompt_set": prompts,
        "file": rel,
    }


def _parquet_manifest(path: Path) -> tuple[str, dict | None]:
    """(schema signature, manifest) of a parquet file: the manifest is whichever key-value metadata entry holds a
    JSON object with a ``key`` field (only the footer is read)."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    manifest = None
    for v in (schema.metadata or {}).values():
        try:
            obj = json.loads(v)
        except ValueError:
            continue
        if isinstance(obj, dict) and "key" in obj:
            manifest = obj
    return str(schema.remove_metadata()), manifest


def describe(root: str | Path) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """(entries, parquet files grouped by schema) of a store: entries come from JSON sidecars with a ``key`` and
    from parquet files' manifests."""
    entries: list[dict[str, Any]] = []
    groups: dict[str, list[str]] = {}
    for rel, p in entry_files(Path(root)).items():
        manifest = None
        if rel.endswith(".parquet"):
            sig, manifest = _parquet_manifest(p)
            groups.setdefault(sig, []).append(rel)
        elif rel.endswith(".json"):
            try:
                manifest = json.loads(p.read_text())
            except (ValueError, UnicodeDecodeError):
                manifest = None
        entry = _entry_from_manifest(manifest, rel) if isinstance(manifest, Mapping) else None
        if entry:
            entries.append(entry)
    return entries, {
        f"config_{i}" if i else "default": files
        for i, files in enumerate(sorted(groups.values(), key=len, reverse=True))
    }


def _table(rows: Iterable[Mapping[str, Any]], fields: tuple[str, ...]) -> str:
    """A markdown table: the card is markdown, which the Hub renders."""
    lines = ["| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    lines += ["| " + " | ".join(str(r.get(f, "-")) for f in fields) + " |" for r in rows]
    return "\n".join(lines)


def dataset_card(root: str | Path, repo_id: str) -> str:
    entries, configs = describe(root)
    return _card(entries, configs, repo_id)


def dataset_card_files(local: Mapping[str, bytes], others: Iterable[str], repo_id: str) -> str:
    """The card of a pushed revision: the pushed baselines (``local``, their bytes) and the files already on the
    Hub that this push keeps (``others``: listed by path; their manifests are not downloaded)."""
    import pyarrow as pa

    entries, parquet = [], []
    for rel, data in local.items():
        _, manifest = _parquet_manifest(pa.BufferReader(data))
        entry = _entry_from_manifest(manifest, rel) if isinstance(manifest, Mapping) else None
        entries.append(entry or {"file": rel})
        parquet.append(rel)
    for rel in sorted(set(others) - set(local)):
        entries.append({"file": rel})
        parquet += [rel] if rel.endswith(".parquet") else []
    return _card(entries, {"default": sorted(parquet)} if parquet else {}, repo_id)


def _card(entries: list[dict[str, Any]], configs: dict[str, list[str]], repo_id: str) -> str:
    import yaml

    front: dict[str, Any] = {"pretty_name": f"lpdiff baselines ({repo_id})", "tags": ["lpdiff", "logprobs"]}
    if configs:
        front["configs"] = [
            {"config_name": name, "data_files": [{"split": "train", "path": files}]} for name, files in configs.items()
        ]
    body = (
        f"# lpdiff baselines\n\nReference logprob runs for `lpdiff` ({len(entries)} entries). Use them with "
        f"`lpdiff run --baselines hf://datasets/{repo_id}@<commit>`; `baselines.lock` in the project pins the "
        "commit.\n\n"
    )
    body += _table(sorted(entries, key=lambda e: tuple(str(e.get(f, "-")) for f in ENTRY_FIELDS)), ENTRY_FIELDS) + "\n"
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + body
