"""Content-addressed store of reference runs (baselines) in a local directory.

A key (store_key.py) hashes a canonical description of what was computed (model and adapter identity, prompts,
dtype, TP, engine, top-k). Its value is one parquet file, ``root/<digest[:2]>/<digest>.parquet``, holding the run
and its manifest (see store_format): written whole and renamed into place (see store_files), so pytest-xdist workers
and concurrent regens can share one store and a kill never leaves a valid baseline unreadable. Many prompt sets,
depths and reference engines coexist; nothing is deleted except by ``prune`` (or ``delete`` of one named key). Every
read checks the content against the key (see ``check_content``): a file written by anyone else is trusted for
nothing.
"""

from __future__ import annotations

import builtins
import datetime
import errno
import functools
import hashlib
import platform
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from lpdiff.harness.pipeline import store_format
from lpdiff.harness.pipeline.store_errors import (
    BaselineCorrupt,
    BaselineError,
    BaselineExists,
    BaselineMissing,
    BaselineStale,
    BaselineStorePath,
)
from lpdiff.harness.pipeline.store_files import (
    LOCK_DIR,
    atomic_write,
    read_regular,
    sweep_temps,
    temp_files,
    write_lock,
)
from lpdiff.harness.pipeline.store_key import BaselineKey, canonical_json, key_from_manifest
from lpdiff.harness.types import LogprobRun, canonical_hash, prompts_hash

__all__ = [
    "BaselineCorrupt",
    "BaselineError",
    "BaselineExists",
    "BaselineMissing",
    "BaselineStale",
    "BaselineStore",
    "BaselineStorePath",
    "StoreEntry",
    "path_lock",
]

FORMAT = store_format.FORMAT
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def path_lock(path: str | Path) -> FileLock:
    """An inter-process lock for one file outside the baseline store (thresholds.json). It lives in the temp dir,
    not beside the file, so that a read-only checkout never gets lock files. Guards processes of one host."""
    name = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    lock_dir = Path(tempfile.gettempdir()) / "lpdiff-locks"
    lock_dir.mkdir(exist_ok=True)
    return FileLock(str(lock_dir / f"{name}.lock"))


@functools.lru_cache(maxsize=1)
def _libraries() -> dict[str, str]:
    import pyarrow

    from lpdiff import __version__
    from lpdiff.harness.pipeline.provenance import git_commit

    return {
        "lpdiff": __version__,
        "commit": git_commit(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pyarrow.__version__,
    }


def _same_arrays(a: LogprobRun, b: LogprobRun) -> bool:
    xa, xb = a.to_arrays(), b.to_arrays()
    return xa.keys() == xb.keys() and all(np.array_equal(xa[k], xb[k], equal_nan=True) for k in xa)


@dataclass(slots=True, frozen=True)
class StoreEntry:
    """One file of the store as ``ls`` sees it: a baseline (``key`` set) or a file that is not one (``problem``)."""

    path: Path
    key: BaselineKey | None
    created: str = ""
    size: int = 0
    problem: str | None = None
    sha256: str | None = None  # of the bytes whose content was checked against the key (verified entries only)

    def describe(self) -> str:
        if self.key is None:
            return f"{self.path.name}  UNREADABLE: {self.problem}"
        return f"{self.key.digest[:12]}  {self.created}  {self.key.label()}"


class BaselineStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # -- paths and their errors ------------------------------------------------------------------------------------
    def path(self, key: BaselineKey) -> Path:
        assert _DIGEST.match(key.digest), f"not a sha256 digest: {key.digest!r}"
        return self.root / key.digest[:2] / f"{key.digest}{store_format.SUFFIX}"

    def _check_folders(self, path: Path) -> None:
        for folder in (self.root, path.parent):
            if folder.exists() and not folder.is_dir():
                what = "the baseline store" if folder == self.root else "a file where the baseline store expects a"
                raise BaselineStorePath(
                    f"{what} folder {folder} is a file; "
                    + (
                        "pass --baselines (or LPDIFF_BASELINES) a folder"
                        if folder == self.root
                        else "move that file out of the store"
                    )
                )

    def _os_error(self, e: OSError, path: Path) -> BaselineStorePath:
        if e.errno in (errno.EEXIST, errno.ENOTDIR):
            return BaselineStorePath(
                f"{e.filename or path}: a file stands where the baseline store expects a "
                "folder; move it out of the store or pass --baselines another folder"
            )
        return BaselineStorePath(
            f"cannot write to the baseline store {self.root} ({e.strerror or e} at "
            f"{e.filename or path}); pass --baselines (or LPDIFF_BASELINES) a writable folder"
        )

    # -- reading (never locks, never writes) ---------------------------------------------------------------------
    def get(self, key: BaselineKey) -> LogprobRun:
        """The stored run, checksum-verified. Raises BaselineMissing / BaselineStale / BaselineCorrupt /
        BaselineStorePath, each naming the path and the fix."""
        path = self.path(key)
        self._check_folders(path)
        try:
            run, manifest = store_format.read(path)
        except FileNotFoundError:
            raise self._absent(key, path) from None
        except BaselineCorrupt as e:
            raise BaselineCorrupt(f"{e}; {key.regen_hint()}") from None
        stored = canonical_json(manifest.get("key"))
        if stored != key.description:
            raise BaselineStale(
                f"the baseline stored at {path} describes another computation than "
                f"{key.label()} (hash collision or edited file): stored {stored}, wanted "
                f"{key.description}; {key.regen_hint()}"
            )
        try:
            check_content(path, run, manifest)
        except BaselineCorrupt as e:
            raise BaselineCorrupt(f"{e}; {key.regen_hint()}") from None
        return run

    def _absent(self, key: BaselineKey, path: Path) -> BaselineError:
        legacy = path.with_suffix(".json")
        if legacy.exists():
            return BaselineStale(
                f"the baseline for {key.label()} is stored in the old .npz format at {legacy}; "
                f"convert the store with `python -m lpdiff.harness.pipeline.store_legacy "
                f"{self.root}`, or {key.regen_hint()}"
            )
        stale = self.find_stale(key)
        if stale:
            return BaselineStale(
                f"the baseline for {key.label()} was computed from something else: "
                f"{self._differences(key, stale[0])} changed; {key.regen_hint()}"
            )
        return BaselineMissing(
            f"no baseline for {key.label()} in {self.root} (key {key.digest[:12]}); {key.regen_hint()}"
        )

    def manifest(self, key: BaselineKey) -> dict[str, Any]:
        """The stored manifest of ``key`` (provenance, metadata), without reading the numbers."""
        path = self.path(key)
        self._check_folders(path)
        try:
            return store_format.read_manifest(path)
        except FileNotFoundError:
            raise self._absent(key, path) from None

    def ls(self) -> list[StoreEntry]:
        """Every baseline file in the store, sorted by path, from the manifests alone (fast); files that are not
        readable baselines are listed with their problem. ``scan`` checks contents."""
        self._check_folders(self.root)
        out = []
        for path in sorted(self.root.glob(f"??/*{store_format.SUFFIX}")):
            if not _DIGEST.match(path.stem):
                continue
            try:
                m = store_format.read_manifest(path)
                key = key_from_manifest(m)
                if key.digest != path.stem:
                    raise BaselineCorrupt(f"its manifest names key {key.digest[:12]}")
                out.append(StoreEntry(path, key, str(m.get("created", "")), path.stat().st_size))
            except FileNotFoundError:
                continue  # deleted while listing
            except (BaselineCorrupt, KeyError, TypeError, AttributeError) as e:
                out.append(StoreEntry(path, None, problem=str(e) or type(e).__name__))
        return out

    def verify(self, path: Path) -> StoreEntry:
        """``path`` as a baseline whose content matches its key, read once without following a symlink: the
        manifest's key hashes to the digest that names the file, the numbers pass their checksum and the read-side
        checks (check_content). BaselineCorrupt naming the file otherwise."""
        try:
            data = read_regular(path)
        except OSError as e:
            why = "a symlink (never followed)" if path.is_symlink() else f"unreadable ({e.strerror or e})"
            raise BaselineCorrupt(f"{path} is {why}") from None
        run, manifest = store_format.read(path, data)
        try:
            key = key_from_manifest(manifest)
        except (KeyError, TypeError, AttributeError) as e:
            raise BaselineCorrupt(f"baseline {path} has no key in its manifest ({e})") from None
        if canonical_hash(manifest["key"]) != key.digest or key.digest != path.stem:
            raise BaselineCorrupt(
                f"baseline {path}: its manifest's key does not hash to the digest that names the "
                "file (a copied, renamed or forged file)"
            )
        check_content(path, run, manifest)
        return StoreEntry(
            path, key, str(manifest.get("created", "")), len(data), sha256=hashlib.sha256(data).hexdigest()
        )

    def scan(self) -> tuple[list[StoreEntry], list[StoreEntry]]:
        """(baselines whose content matches their key, every other file or link in the store with its problem):
        what push uploads and prune may remove, and what both refuse to touch. Skipped as the store's own: the
        write locks, temp files of writers, a .gitignore at the root."""
        self._check_folders(self.root)
        temps = set(temp_files(self.root))
        good, bad = [], []
        for path in sorted(self.root.rglob("*")):
            rel = path.relative_to(self.root)
            if (
                rel.parts[0] == LOCK_DIR
                or path in temps
                or rel.as_posix() == ".gitignore"
                or (path.is_dir() and not path.is_symlink())
            ):
                continue
            if (
                len(rel.parts) != 2
                or rel.parts[0] != path.stem[:2]
                or not _DIGEST.match(path.stem)
                or path.suffix != store_format.SUFFIX
            ):
                kind = "a symlink" if path.is_symlink() else "a folder" if path.is_dir() else "a file"
                bad.append(
                    StoreEntry(
                        path,
                        None,
                        problem=f"{kind} that is not a baseline (baselines are ??/<sha256>{store_format.SUFFIX})",
                    )
                )
                continue
            try:
                good.append(self.verify(path))
            except FileNotFoundError:
                continue  # deleted while scanning
            except BaselineCorrupt as e:
                bad.append(StoreEntry(path, None, problem=str(e)))
        return good, bad

    def list(self) -> list[BaselineKey]:
        return [e.key for e in self.ls() if e.key is not None]

    def find_stale(self, key: BaselineKey) -> builtins.list[BaselineKey]:  # `list` is a method here
        """Stored keys of the same computation as ``key`` (names, depth, prompt set, engine, dtype, TP, top-k,
        options) but other content: what a regen of ``key`` supersedes. Other prompt sets, depths or reference
        engines are other computations and never stale."""
        want = key.computation()
        return [k for k in self.list() if k.digest != key.digest and k.computation() == want]

    @staticmethod
    def _differences(key: BaselineKey, old: BaselineKey) -> str:
        new_f, old_f = key.fields, old.fields
        return ", ".join(
            f"{k} ({canonical_json(old_f.get(k))} -> {canonical_json(new_f.get(k))})"
            for k in sorted(new_f)
            if new_f.get(k) != old_f.get(k)
        )

    # -- writing -----------------------------------------------------------------------------------------------
    def put(self, key: BaselineKey, run: LogprobRun, overwrite: bool = False) -> bool:
        """Store ``run`` under ``key`` as one file. Returns False when an equal run (same arrays; metadata such as
        wall time may differ) is already there, e.g. another xdist worker won the race. A different stored run
        raises BaselineExists unless ``overwrite``. Other keys are never touched: superseded baselines stay until
        ``prune``."""
        self._check_run(key, run)
        path = self.path(key)
        self._check_folders(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with write_lock(self.root, key.digest):
                sweep_temps(self.root, path)
                if not overwrite and self._equal_or_refuse(key, path, run):
                    return False
                manifest = self._manifest(key, run)
                atomic_write(path, lambda fh: store_format.write(store_format.encode(run, manifest), fh))
        except OSError as e:
            raise self._os_error(e, path) from None
        return True

    def _equal_or_refuse(self, key: BaselineKey, path: Path, run: LogprobRun) -> bool:
        try:
            stored, _ = store_format.read(path)
        except FileNotFoundError:
            return False
        except BaselineCorrupt as e:
            raise BaselineCorrupt(f"{e}; refusing to write over it without overwrite: {key.regen_hint()}") from None
        if _same_arrays(stored, run):
            return True
        raise BaselineExists(
            f"a different baseline is already stored for {key.label()} at {path}; refusing to "
            f"overwrite it. If the reference really changed, {key.regen_hint()}"
        )

    def _manifest(self, key: BaselineKey, run: LogprobRun) -> dict[str, Any]:
        meta = run.meta
        provenance = {
            "engine": meta.get("engine", key.fields["engine"]),
            "engine_version": meta.get("engine_version"),
            "dtype": meta.get("dtype", key.fields["dtype"]),
            "tp": meta.get("tp", key.fields["tp"]),
            "device": meta.get("device"),
            **_libraries(),
        }
        return {
            "format": FORMAT,
            "digest": key.digest,
            "key": key.fields,
            "names": {"model": key.model_name, "adapter": key.adapter_name, "prompt_set": key.prompt_set},
            "meta": meta,
            "provenance": provenance,
            "data_sha256": store_format.data_sha256(run),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    def _check_run(self, key: BaselineKey, run: LogprobRun) -> None:
        f = key.fields
        if prompts_hash([p.token_ids for p in run.prompts]) != f["prompts"]:
            raise ValueError(
                f"the run is over other prompts than the key for {key.label()} was built from; "
                "build the key from the same prompts the engine ran"
            )
        widths = {None if p.topk_ids is None else p.topk_ids.shape[1] for p in run.prompts}
        if f["top_k"] and widths != {f["top_k"]}:
            raise ValueError(
                f"the key asks for top_k={f['top_k']} but the run's top-k widths are {widths}; "
                f"run the engine with top_k={f['top_k']}"
            )

    # -- removing (explicit only) ----------------------------------------------------------------------------------
    def delete(self, key: BaselineKey) -> bool:
        """Remove the baseline of ``key`` (an explicit request; regen never calls this)."""
        path = self.path(key)
        if not path.exists():
            return False
        try:
            with write_lock(self.root, key.digest):
                path.unlink(missing_ok=True)
        except OSError as e:
            raise self._os_error(e, path) from None
        return True

    def prune(self, keep: Iterable[BaselineKey | str] | None = None, dry_run: bool = True) -> builtins.list[StoreEntry]:
        """What to remove, removed unless ``dry_run`` (see ``remove``): with ``keep`` (keys or digests), every
        baseline not in it; without, each baseline superseded by a newer one of the same computation (see
        ``find_stale``). Only baselines whose content matches their key are candidates, and only they can supersede
        another: a file's own manifest is never trusted (a forged or damaged file removes nothing and is never
        removed; ``scan`` lists it). Returns the entries, sorted by path."""
        good, _ = self.scan()

        def key_of(e: StoreEntry) -> BaselineKey:
            assert e.key is not None  # scan's good entries are baselines
            return e.key

        if keep is not None:
            kept = {k if isinstance(k, str) else k.digest for k in keep}
            drop = [e for e in good if key_of(e).digest not in kept]
        else:
            newest: dict[tuple, StoreEntry] = {}
            for e in good:
                c = key_of(e).computation()
                if c not in newest or (e.created, e.path.stat().st_mtime) > (
                    newest[c].created,
                    newest[c].path.stat().st_mtime,
                ):
                    newest[c] = e
            drop = [e for e in good if newest[key_of(e).computation()] is not e]
        drop = sorted(drop, key=lambda e: e.path)
        if not dry_run:
            self.remove(drop)
        return drop

    def remove(self, entries: Iterable[StoreEntry]) -> builtins.list[StoreEntry]:
        """Delete verified entries (from ``prune``), each under its key's write lock and only while its bytes are
        still the ones verified; returns those that changed meanwhile and were kept. Temp files of writers that
        are gone are swept too."""
        changed = []
        for e in entries:
            assert e.key is not None and e.sha256 is not None, "remove takes verified entries only"
            try:
                with write_lock(self.root, e.key.digest):
                    try:
                        now = hashlib.sha256(read_regular(e.path)).hexdigest()
                    except FileNotFoundError:
                        continue
                    except OSError:
                        now = None
                    if now != e.sha256:
                        changed.append(e)
                        continue
                    e.path.unlink(missing_ok=True)
            except OSError as err:
                raise self._os_error(err, e.path) from None
        sweep_temps(self.root)
        return changed


def check_content(path: Path, run: LogprobRun, manifest: dict[str, Any]) -> None:
    """A stored run that can be what its key says: the prompts and top-k width its key names, finite logprobs
    <= 0, top-k ids in the vocabulary and top-k data consistent with the logprobs (sorted, distinct ids, the
    actual token's entry equal to its logprob). Checked at every read: the write-side checks do not cover a file
    written by anyone else. BaselineCorrupt naming the file."""
    raw_key = manifest.get("key")
    key = raw_key if isinstance(raw_key, dict) else {}
    if prompts_hash([p.token_ids for p in run.prompts]) != key.get("prompts"):
        raise BaselineCorrupt(f"baseline {path} holds other prompts than its key names")
    widths = {None if p.topk_ids is None else p.topk_ids.shape[1] for p in run.prompts}
    if key.get("top_k") and widths != {key["top_k"]}:
        raise BaselineCorrupt(
            f"baseline {path} has top-k width(s) {sorted(map(str, widths))}, its key top_k={key['top_k']}"
        )
    from lpdiff.harness.spec.validate import ValidationError, check_run, check_topk_consistency  # imports torch
    from lpdiff.harness.spec.validate.runs import run_vocab

    fix = "the file was damaged or forged"
    try:
        check_run(run, f"baseline {path}", run_vocab(run.meta), fix=fix)
        check_topk_consistency(run, f"baseline {path}", fix=fix)
    except ValidationError as e:
        raise BaselineCorrupt(str(e)) from None
