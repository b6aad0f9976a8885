"""An HF cache populated the way huggingface_hub writes it, from a local directory: ``{models,datasets}--ORG--NAME/
blobs/<etag>`` (sha256 for safetensors, as for LFS files; the git blob sha1 for the rest), ``refs/<branch>`` holding
the commit and ``snapshots/<commit>/<file>`` symlinks into blobs. The real huggingface_hub / transformers / datasets
code then reads it with HF_HUB_OFFLINE=1 (no Hub is reachable from the tests)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def _etag(data: bytes, lfs: bool) -> str:
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def populate(
    hub_cache: str | Path,
    repo_id: str,
    src: str | Path,
    repo_type: str = "model",
    branch: str | None = "main",
    commit: str | None = None,
    skip: tuple[str, ...] = (),
    listing: bool = True,
) -> tuple[Path, str]:
    """Put every file under ``src`` into ``hub_cache`` as commit ``commit`` (default: derived from the content) of
    ``repo_id``; ``branch`` (when given) points at it; the commit's tree listing (``trees/<commit>.json``, which
    huggingface_hub writes at a download and reads offline) lists every file. Files whose suffix is in ``skip`` are
    listed but not cached, as after a config-only download; ``listing`` False: no tree listing (a cache copied by
    hand, or written by an older huggingface_hub). Returns (snapshot folder, commit)."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    src = Path(src)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    commit = commit or hashlib.sha1(b"".join(p.read_bytes() for p in files) + repo_id.encode()).hexdigest()
    repo = Path(hub_cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    tree = {}
    for p in files:
        data = p.read_bytes()
        lfs = p.suffix == ".safetensors"
        tree[p.relative_to(src).as_posix()] = TreeCacheEntry(
            len(data), _etag(data, False), _etag(data, True) if lfs else None, len(data) if lfs else None
        )
        if p.suffix in skip:
            continue
        blob = repo / "blobs" / _etag(data, lfs)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / p.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    snap.mkdir(parents=True, exist_ok=True)
    if listing:
        write_tree_cache(str(repo), commit, tree)
    if branch:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snap, commit


def offline_home(monkeypatch, tmp_path: Path) -> Path:
    """HF_HOME and lpdiff's cache under ``tmp_path``, HF_HUB_OFFLINE=1; huggingface_hub's module-level offline flag
    (which lpdiff sets from the environment at each call) is restored after the test. Returns the hub cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LPDIFF_CACHE", str(tmp_path / "lpdiff-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    return tmp_path / "hf-home" / "hub"
