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


def populate(hub_cache: str | Path, repo_id: str, src: str | Path, repo_type: str = "model",
             branch: str | None = "main", commit: str | None = None) -> tuple[Path, str]:
    """Put every file under ``src`` into ``hub_cache`` as commit ``commit`` (default: derived from the content) of
    ``repo_id``; ``branch`` (when given) points at it. Returns (snapshot folder, commit)."""
    src = Path(src)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    commit = commit or hashlib.sha1(b"".join(p.read_bytes() for p in files) + repo_id.encode()).hexdigest()
    repo = Path(hub_cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / _etag(data, p.suffix == ".safetensors")
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / p.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    if branch:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snap, commit
