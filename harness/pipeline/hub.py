"""Baseline stores kept in a Hugging Face Hub dataset repo, named ``hf://datasets/ORG/NAME[@REV]``.

A store is treated as a directory tree of files. ``pull`` fetches one revision with ``snapshot_download`` into the
standard HF cache and returns the snapshot folder (a read-only store); with ``HF_HUB_OFFLINE=1`` and a full commit
hash it is served from the cache without a request. Every pulled file is checked against the checksum the Hub
served for it (the cache names each blob by it: sha256 for LFS files, the git blob sha1 for others), because
huggingface_hub checks only a download's length. ``push`` adds the store's verified baselines (nothing else) as ONE
commit on the head with ``parent_commit``: a push racing another gets HTTP 412 and is rebased, never reverting it
(see ``push``); the commit also writes a dataset card (README.md, hub_card.py) listing the entries.

``baselines.lock`` pins the revision (CI reads it): ``#`` comment lines and exactly one line
``hf://datasets/ORG/NAME@<40-hex commit>``, the same string ``--baselines`` takes, so a workflow can pass
``--baselines "$(grep -v '^#' baselines.lock)"``. ``push`` rewrites it with the new commit.

HF_ENDPOINT, HF_HUB_OFFLINE and HF_HOME / HF_HUB_CACHE are read when a function here is called, not when
huggingface_hub was imported (transformers imports it early): the endpoint and cache are passed to every call,
and the offline flag, which has no parameter, is copied into ``huggingface_hub.constants`` first.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lpdiff.harness.pipeline.hub_card import CARD, dataset_card_files, describe, entry_files
from lpdiff.harness.spec.errors import InputError

LOCK_NAME = "baselines.lock"
_SKIP = {CARD, ".gitattributes"}  # repo files that are not store entries
_URL = re.compile(r"^hf://datasets/([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(InputError):
    """A Hub store problem; the message names the repo and the command that fixes it."""


class HubConflict(HubError):
    """The branch moved since the revision a push was based on."""


@dataclass(slots=True, frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", self.repo_id):
            raise HubError(f"bad Hub dataset id {self.repo_id!r}: expected ORG/NAME")

    @property
    def url(self) -> str:
        return f"hf://datasets/{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def is_hub_url(text: str | os.PathLike) -> bool:
    return isinstance(text, str) and text.startswith("hf://")


def parse_url(text: str) -> HubRef:
    """``hf://datasets/ORG/NAME[@REV]`` -> HubRef; HubError naming the expected form otherwise."""
    m = _URL.match(text.strip())
    if not m:
        raise HubError(
            f"bad baselines URL {text!r}: expected hf://datasets/ORG/NAME or hf://datasets/ORG/NAME@REV "
            "(REV a branch, tag or 40-hex commit)"
        )
    return HubRef(m.group(1), m.group(2))


# -- lock file ------------------------------------------------------------------------------------------------
def read_lock(path: str | Path, repo_id: str | None = None) -> HubRef | None:
    """The pinned repo and commit, or None when there is no lock file. With ``repo_id``, a lock pinning another
    repo is a HubError (using it, or ignoring it, would both be silent guesses)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HubError(
            f"{path} is not a readable UTF-8 text file ({e}); rewrite it with "
            "`lpdiff baselines pull hf://datasets/ORG/NAME@REV`"
        ) from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    ref = parse_url(lines[0]) if len(lines) == 1 and _URL.match(lines[0].strip()) else None
    if ref is None or not ref.revision or not _COMMIT.match(ref.revision):
        raise HubError(
            f"{path} must hold one line hf://datasets/ORG/NAME@<40-hex commit>; rewrite it with "
            "`lpdiff baselines pull hf://datasets/ORG/NAME@REV`"
        )
    if repo_id is not None and ref.repo_id != repo_id:
        raise HubError(
            f"{path} pins {ref.url}, not hf://datasets/{repo_id}: name the revision "
            f"(hf://datasets/{repo_id}@REV), pass --lock another file, or run `lpdiff baselines pull "
            f"hf://datasets/{repo_id}` to pin that repo instead"
        )
    return ref


def write_lock(path: str | Path, ref: HubRef) -> None:
    assert ref.revision and _COMMIT.match(ref.revision), ref
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per writer: two pushes may end at once
    tmp.write_text(
        f"# Baselines revision used by `lpdiff run` and CI; `lpdiff baselines pull|push` rewrite it.\n{ref.url}\n"
    )
    tmp.replace(path)


# -- environment and client -----------------------------------------------------------------------------------
def _true(v: str | None) -> bool:
    return (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@dataclass(slots=True, frozen=True)
class HubEnv:
    endpoint: str
    offline: bool
    cache_dir: Path

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> HubEnv:
        """The same precedence huggingface_hub.constants applies at its import, applied now."""
        env = os.environ if env is None else env
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
        )
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
        return cls(
            endpoint=(env.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/"),
            offline=_true(env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE")),
            cache_dir=Path(os.path.expandvars(os.path.expanduser(cache))),
        )


def _client(env: HubEnv):
    import huggingface_hub
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = env.offline  # read by every request; it has no per-call parameter
    return huggingface_hub, huggingface_hub.HfApi(endpoint=env.endpoint)


def _explain(e: Exception, ref: HubRef, env: HubEnv) -> HubError:
    from huggingface_hub import errors

    where = f"{ref.url} at {env.endpoint}"
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(
            f"{where}: no revision {ref.revision!r}; list the repo's commits on the Hub or fix the "
            "revision in --baselines / baselines.lock"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(
            f"{where}: no such dataset repo (or no access: set HF_TOKEN); create it with `lpdiff baselines push`"
        )
    if env.offline and isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return HubError(
            f"{where} is not in the HF cache ({env.cache_dir}) and HF_HUB_OFFLINE is set: run "
            "`lpdiff baselines pull` once with network access, or unset HF_HUB_OFFLINE"
        )
    return HubError(f"{where}: {type(e).__name__}: {e}")


# -- checksums ------------------------------------------------------------------------------------------------
def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _verify_snapshot(folder: Path, ref: HubRef) -> None:
    """Each cached file must hash to the etag its blob is named by; a mismatch removes the bad blob so that the
    next pull downloads it again."""
    for rel, p in entry_files(folder).items():
        if not p.is_symlink():
            continue  # a cache without symlinks keeps no etag beside the file
        blob = Path(os.path.realpath(p))
        data, want = blob.read_bytes(), blob.name
        got = hashlib.sha256(data).hexdigest() if len(want) == 64 else git_blob_sha1(data)
        if got != want:
            blob.unlink(missing_ok=True)
            p.unlink(missing_ok=True)
            raise HubError(
                f"{rel} pulled from {ref.url} is corrupt: its checksum is {got}, the Hub's is {want}; "
                "the bad copy was removed from the HF cache: run `lpdiff baselines pull` again"
            )


def _remote_checksums(api, ref: HubRef) -> dict[str, str]:
    from huggingface_hub.hf_api import RepoFile

    return {
        f.path: (f.lfs.sha256 if f.lfs is not None else f.blob_id)
        for f in api.list_repo_tree(ref.repo_id, recursive=True, revision=ref.revision, repo_type="dataset")
        if isinstance(f, RepoFile)
    }


# -- pull -----------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Pulled:
    ref: HubRef  # revision = the full commit hash
    path: Path  # the snapshot folder in the HF cache: a read-only store


def _pin(ref: HubRef, lock: str | Path | None, repin: bool = False) -> HubRef:
    """``ref`` at its revision, else the lock's commit, else main. A lock pinning another repo is refused unless
    ``repin`` (a pull that rewrites the lock for this repo)."""
    if ref.revision:
        return ref
    pinned = read_lock(lock, None if repin else ref.repo_id) if lock is not None else None
    if pinned is not None and pinned.repo_id == ref.repo_id:
        return pinned
    return HubRef(ref.repo_id, "main")


def pull(
    source: str | HubRef, *, lock: str | Path | None = LOCK_NAME, update_lock: bool = False, env: HubEnv | None = None
) -> Pulled:
    """Fetch a revision (the given one, else the lock's for that repo, else main) and check every file.
    ``update_lock`` writes the resolved commit to ``lock``."""
    env = env or HubEnv.from_environ()
    ref = _pin(parse_url(source) if isinstance(source, str) else source, lock, repin=update_lock)
    if env.offline and not _COMMIT.match(ref.revision or ""):
        raise HubError(
            f"{ref.url}: offline (HF_HUB_OFFLINE) a pull needs a 40-hex commit, not {ref.revision!r}; "
            "pin one with `lpdiff baselines pull` online (it writes baselines.lock)"
        )
    hf, _ = _client(env)
    try:
        folder = Path(
            hf.snapshot_download(
                ref.repo_id,
                repo_type="dataset",
                revision=ref.revision,
                cache_dir=env.cache_dir,
                endpoint=env.endpoint,
                local_files_only=env.offline,
            )
        )
    except Exception as e:  # every huggingface_hub / httpx failure becomes one message naming the fix
        raise _explain(e, ref, env) from e
    pulled = Pulled(HubRef(ref.repo_id, folder.name), folder)
    _verify_snapshot(folder, pulled.ref)
    if update_lock and lock is not None:
        write_lock(lock, pulled.ref)
    return pulled


def resolve_store(spec: str, *, lock: str | Path | None = LOCK_NAME) -> Path:
    """A ``--baselines`` value -> a store directory: hf:// URLs are pulled (or served from the cache)."""
    return pull(spec, lock=lock).path if is_hub_url(spec) else Path(spec)


# -- push -----------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Pushed:
    ref: HubRef  # the new commit (or the head when nothing changed)
    added: list[str] = field(default_factory=list)  # new or changed files
    deleted: list[str] = field(default_factory=list)
    base: str | None = None  # the revision the push was based on; the commit's parent is the head it found


def _store_index(root: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every baseline of the local store whose content matches its key (read once,
    never through a symlink: these bytes are what is uploaded). Any other file in the store refuses the push,
    named: a stray notes file or a link to a private file must not reach a public dataset."""
    from lpdiff.harness.pipeline.store import BaselineStore
    from lpdiff.harness.pipeline.store_files import read_regular

    good, bad = BaselineStore(root).scan()
    if bad:
        names = "; ".join(f"{e.path} ({e.problem})" for e in bad[:5]) + (
            f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
        )
        raise HubError(
            f"refusing to push {root}: {len(bad)} file(s) in it are not baselines whose content matches "
            f"their key: {names}. Move them out of the store (a push uploads only the store's baselines)"
        )
    out = {}
    for e in good:
        data = read_regular(e.path)
        if hashlib.sha256(data).hexdigest() != e.sha256:
            raise HubError(f"{e.path} changed while the push read the store; push again")
        out[e.path.relative_to(root).as_posix()] = data
    return out


def _checksum(data: bytes, like: str | None) -> str:
    """The checksum the Hub would give these bytes, in the same kind as ``like`` (sha256 for LFS files)."""
    return hashlib.sha256(data).hexdigest() if like is not None and len(like) == 64 else git_blob_sha1(data)


def _head(api, ref: HubRef) -> str:
    return api.dataset_info(ref.repo_id, revision="main").sha


def push(
    store: str | Path,
    target: str | HubRef,
    *,
    lock: str | Path | None = LOCK_NAME,
    parent: str | None = None,
    message: str = "lpdiff: update baselines",
    env: HubEnv | None = None,
    delete: bool = False,
    attempts: int = 5,
) -> Pushed:
    """Add the local store's baselines to the branch ``main`` of the target repo, with its card, in one commit.

    The base is ``parent`` or the lock's commit for that repo. The commit is made on the branch head with
    ``parent_commit`` = that head, so the Hub refuses it (HTTP 412) when another push lands in between; it is then
    rebased on the new head and retried (``attempts`` in all). Rebasing only adds: files others added stay, and a
    file that both the head and this store changed since the base is a HubConflict naming it. Nothing is deleted
    unless ``delete`` is given, and then only when the base is the head (the store was made from what is there);
    the deleted files are listed in the result. A repo that does not exist yet is created. The lock is rewritten
    with the new commit."""
    env = env or HubEnv.from_environ()
    if env.offline:
        raise HubError("cannot push with HF_HUB_OFFLINE set; unset it")
    ref = parse_url(target) if isinstance(target, str) else target
    root = Path(store)
    if not root.is_dir():
        raise HubError(f"store {root} is not a directory; pass the local baselines directory to push")
    local = _store_index(root)
    hf, api = _client(env)
    pinned = read_lock(lock, ref.repo_id) if lock is not None else None
    base = parent or (pinned.revision if pinned is not None else None)
    for attempt in range(attempts):
        try:
            if base is None:
                api.create_repo(ref.repo_id, repo_type="dataset", exist_ok=True)
            head = _head(api, ref)
            remote = _remote_checksums(api, HubRef(ref.repo_id, head))
            if base is None and set(remote) - _SKIP:
                raise HubError(
                    f"{ref.url} already holds baselines and no base revision is known: run "
                    f"`lpdiff baselines pull {ref.url}` (it writes {LOCK_NAME}), then push again"
                )
            at_base = remote if base in (None, head) else _remote_checksums(api, HubRef(ref.repo_id, base))
        except HubError:
            raise
        except Exception as e:
            raise _explain(e, HubRef(ref.repo_id, base), env) from e
        ops, added, clash = [], [], []
        for rel, data in local.items():
            if remote.get(rel) == _checksum(data, remote.get(rel)):
                continue
            if rel in remote and remote.get(rel) != at_base.get(rel):
                clash.append(rel)  # changed on the Hub since the base, and differently here
            ops.append(hf.CommitOperationAdd(path_in_repo=rel, path_or_fileobj=data))
            added.append(rel)
        if clash:
            raise HubConflict(
                f"{ref.url}: {len(clash)} file(s) changed on the Hub since {str(base)[:12]} (the revision "
                f"this push is based on) and differ here: {', '.join(clash[:5])}; nothing was "
                f"written. Run `lpdiff baselines pull {ref.url}@main`, decide which runs to keep, "
                "then push again"
            )
        deleted = sorted(set(remote) - set(local) - _SKIP) if delete else []
        if deleted and base != head:
            raise HubConflict(
                f"{ref.url}: --delete would remove {len(deleted)} file(s), but the Hub moved from "
                f"{(base or 'nothing')[:12]} (this store's base) to {head[:12]}: they may be another "
                f"push's runs. Nothing was written. Run `lpdiff baselines pull {ref.url}@main`, then "
                "push again"
            )
        ops += [hf.CommitOperationDelete(path_in_repo=rel) for rel in deleted]
        card = dataset_card_files(local, set(remote) - set(deleted) - _SKIP, ref.repo_id).encode()
        if remote.get(CARD) != git_blob_sha1(card):
            ops.append(hf.CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card))
        if not ops:
            out = Pushed(HubRef(ref.repo_id, head), base=base)
            break
        try:
            info = api.create_commit(
                ref.repo_id, ops, commit_message=message, repo_type="dataset", revision="main", parent_commit=head
            )
        except hf.errors.HfHubHTTPError as e:
            if e.response is not None and e.response.status_code in (409, 412) and attempt + 1 < attempts:
                continue  # another push landed between our read of the head and this commit: rebase on it
            if e.response is not None and e.response.status_code in (409, 412):
                raise HubConflict(
                    f"{ref.url}: the branch moved {attempts} times while this push was made; nothing "
                    "was written. Push again"
                ) from e
            raise _explain(e, ref, env) from e
        out = Pushed(HubRef(ref.repo_id, info.oid), added, deleted, base)
        break
    if lock is not None:
        write_lock(lock, out.ref)
    return out


# -- ls / diff ------------------------------------------------------------------------------------------------
def ls(source: str | HubRef, *, lock: str | Path | None = LOCK_NAME) -> list[dict[str, Any]]:
    """The entries (model, adapter, engine, dtype, TP, prompt set, file) of a pulled revision."""
    return describe(pull(source, lock=lock).path)[0]


def _entry_name(rel: str) -> str:
    """A store entry's files share a path up to the first dot of the file name (``ab/abcd.json`` + ``.npz``)."""
    head, _, name = rel.rpartition("/")
    return (f"{head}/" if head else "") + name.split(".")[0]


@dataclass(slots=True, frozen=True)
class StoreDiff:
    added: list[str]
    removed: list[str]
    changed: list[str]  # entries whose files differ in any checksum


def diff(repo: str | HubRef, rev1: str, rev2: str, *, env: HubEnv | None = None) -> StoreDiff:
    """Entries added / removed / changed from ``rev1`` to ``rev2``, from the two revisions' file lists and
    checksums (the tree listing online; the cached snapshots offline)."""
    env = env or HubEnv.from_environ()
    base = parse_url(repo) if isinstance(repo, str) else repo
    sums = []
    for rev in (rev1, rev2):
        ref = HubRef(base.repo_id, rev)
        if env.offline:
            folder = pull(ref, lock=None, env=env).path
            sums.append({rel: Path(os.path.realpath(p)).name for rel, p in entry_files(folder).items()})
            continue
        _, api = _client(env)
        try:
            sums.append({k: v for k, v in _remote_checksums(api, ref).items() if k not in _SKIP})
        except Exception as e:
            raise _explain(e, ref, env) from e
    entries = []
    for s in sums:
        grouped: dict[str, set[tuple[str, str]]] = {}
        for rel, checksum in s.items():
            grouped.setdefault(_entry_name(rel), set()).add((rel, checksum))
        entries.append(grouped)
    a, b = entries
    return StoreDiff(
        added=sorted(set(b) - set(a)),
        removed=sorted(set(a) - set(b)),
        changed=sorted(k for k in set(a) & set(b) if a[k] != b[k]),
    )
