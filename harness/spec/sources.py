"""Where a model or adapter named on the command line lives: a local directory, or a Hugging Face Hub repo
``ORG/NAME[@REV][/SUBDIR]`` (``hf://datasets/ORG/NAME...`` for a dataset repo, where SGLang keeps its test adapters)
fetched with ``snapshot_download`` into the standard HF cache. ``HF_HUB_OFFLINE``, ``HF_HOME`` and ``HF_HUB_CACHE``
are read at each call, not when huggingface_hub was imported (transformers imports it early).

A Hub source is identified by repo + commit (hashing a 60 GB snapshot every run would cost minutes); a local
directory by its content hash, cached per (path, file sizes, mtimes) so it is computed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.types import HASHED_SUFFIXES, dir_hash

# ORG/NAME, optional @REV (branch, tag or commit; no slash), optional /SUBDIR inside the repo
_HUB = re.compile(r"^(?:hf://)?(?:(models|datasets)/)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w.-]+))?(?:/(.+))?$")
CONFIG_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]  # config, tokenizer, chat template
WEIGHT_FILES = ["*.safetensors"]  # never *.bin/*.pt (pickles) or original/ copies
_FALSY = ("", "0", "false", "no", "off")


def cache_root() -> Path:
    """lpdiff's own cache (cut checkpoints, directory hashes): $LPDIFF_CACHE or ~/.cache/lpdiff."""
    return Path(os.environ.get("LPDIFF_CACHE") or Path.home() / ".cache" / "lpdiff")


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in _FALSY


@dataclass(slots=True, frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None
    repo_type: str = "model"  # "model" | "dataset"
    subfolder: str = ""
    typed: bool = False  # the user said models/ or datasets/: do not try the other kind

    def __post_init__(self):
        assert self.repo_type in ("model", "dataset"), self.repo_type

    @property
    def label(self) -> str:
        kind = "dataset " if self.repo_type == "dataset" else ""
        return f"Hub {kind}repo {self.repo_id}" + (f"@{self.revision}" if self.revision else "")

    def fetch_command(self) -> str:
        cmd = f"hf download {self.repo_id}"
        cmd += " --repo-type dataset" if self.repo_type == "dataset" else ""
        return cmd + (f" --revision {self.revision}" if self.revision else "")

    def other_kind(self) -> HubRef:
        return HubRef(
            self.repo_id, self.revision, "dataset" if self.repo_type == "model" else "model", self.subfolder, True
        )


def parse_hub(text: str) -> HubRef | None:
    """``[hf://][models/|datasets/]ORG/NAME[@REV][/SUBDIR]`` -> HubRef; None when ``text`` is not of that form."""
    m = _HUB.match(text.strip())
    if m is None:
        return None
    kind, repo, rev, sub = m.groups()
    return HubRef(repo, rev, "dataset" if kind == "datasets" else "model", (sub or "").strip("/"), kind is not None)


@dataclass(slots=True, frozen=True)
class Snapshot:
    path: Path  # the snapshot folder (subfolder applied)
    commit: str  # 40-hex commit the revision resolved to
    ref: HubRef


def snapshot(ref: HubRef, allow_patterns: list[str] | None) -> Snapshot:
    """``snapshot_download`` of ``ref`` at its revision into the HF cache (only ``allow_patterns``); every failure
    is one SpecError naming the repo, the revision and the command that fetches it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    constants.HF_HUB_OFFLINE = offline
    patterns = (
        None if allow_patterns is None else [f"{ref.subfolder}/{p}" if ref.subfolder else p for p in allow_patterns]
    )
    fetch = f"fetch it with `{ref.fetch_command()}`"
    try:
        path = Path(
            snapshot_download(
                ref.repo_id,
                repo_type=ref.repo_type,
                revision=ref.revision,
                cache_dir=str(hub_cache()),
                allow_patterns=patterns,
                local_files_only=offline,
            )
        )  # offline: even a commit hash asks no server
    except RevisionNotFoundError:
        raise SpecError(
            f"{ref.label}: no revision {ref.revision!r} (a branch, tag or commit of the repo); "
            f"pass an existing one, e.g. `{HubRef(ref.repo_id, None, ref.repo_type).fetch_command()}` "
            "fetches main"
        ) from None
    except RepositoryNotFoundError:
        raise SpecError(
            f"{ref.label} not found on the Hub (or private/gated: log in with `hf auth login`); "
            f"check the id, then {fetch}"
        ) from None
    except IncompleteSnapshotError as e:
        missing = str(e).split("are missing (")[-1].split(")")[0] if "are missing (" in str(e) else "some files"
        raise SpecError(
            f"{ref.label}: the cached snapshot lacks {missing} (cache {hub_cache()}); {fetch}"
            + (" (with HF_HUB_OFFLINE unset)" if offline else "")
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        why = (
            "is not in the HF cache and HF_HUB_OFFLINE is set"
            if offline
            else f"could not be fetched ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )
        raise SpecError(
            f"{ref.label} {why} (cache {hub_cache()}); {fetch}" + (" (with HF_HUB_OFFLINE unset)" if offline else "")
        ) from None
    commit = path.name
    if ref.subfolder:
        path = path / ref.subfolder
        if not path.is_dir():
            raise SpecError(f"{ref.label} has no folder {ref.subfolder!r} at commit {commit[:12]}")
    return Snapshot(path, commit, ref)


def missing_weights(path: Path) -> list[str]:
    """Safetensors files a checkpoint directory needs and lacks (from its index, else: any *.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [f for f in files if not (path / f).is_file()]
    return [] if any(path.glob("*.safetensors")) else ["*.safetensors"]


# -- local directories -------------------------------------------------------------------------------------------


def _stat_list(path: Path) -> list[list]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in HASHED_SUFFIXES)
    return [[str(f.relative_to(path)), (st := f.stat()).st_size, st.st_mtime_ns] for f in files]


def cached_dir_hash(path: str | Path) -> str:
    """``dir_hash(path)`` (so a copy of a zoo model keys like the zoo model), computed once per (path, each file's
    size and mtime) and kept under ``cache_root()/dir-hashes``."""
    path = Path(path).resolve()
    stats = _stat_list(path)
    entry = cache_root() / "dir-hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        cached = json.loads(entry.read_text())
        if cached.get("stat") == stats and re.fullmatch(r"[0-9a-f]{64}", str(cached.get("hash"))):
            return cached["hash"]
    except (OSError, ValueError):
        pass
    digest = dir_hash(path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"path": str(path), "stat": stats, "hash": digest}))
        tmp.replace(entry)
    except OSError:  # a read-only cache only costs the rehash next time
        pass
    return digest


def checkpoint_dir(path: Path, what: str, need: str) -> Path:
    """``path`` when it is a directory holding ``need`` (config.json / adapter_config.json); SpecError otherwise."""
    if not path.is_dir():
        raise SpecError(f"{what} {str(path)!r} is not a directory")
    if not (path / need).is_file():
        kind = (
            "a Hugging Face checkpoint directory (config.json + *.safetensors)"
            if need == "config.json"
            else "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)"
        )
        raise SpecError(f"{what} directory {str(path)!r} has no {need}; give {kind}")
    return path
