"""Writing the store's files so that no kill at any instant leaves a valid baseline unreadable.

A file is written under a unique temp name in its final directory (created with mode 0666 minus the umask, so a
shared store stays readable to its group), fsynced, and renamed over the final name: a reader sees the old file or
the new one. A writer killed before the rename leaves a temp file; the next write removes those of writers that are
gone. Locks serialise writers of one key only (readers never lock, so a read-only store needs no writable path);
they are ``flock``s on files in the store's own ``.locks/`` folder, which every user of a shared store can reach.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"
LOCK_DIR = ".locks"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TMP = re.compile(r"^\.(?P<final>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + "$")
# Another host's writer on a shared filesystem cannot be asked whether it lives: its temp files go once this old.
FOREIGN_TMP_AGE_S = 24 * 3600.0


def temp_path(final: Path) -> Path:
    return final.parent / f".{final.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write(final: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(fh)`` into a temp file beside ``final``, then rename it into place; the temp file is removed on any
    error (only SIGKILL or power loss can leave one behind, and ``sweep_temps`` removes it later)."""
    tmp = temp_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mkstemp would give 0600, ignoring umask
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(final.parent)


def read_regular(path: Path) -> bytes:
    """The bytes of ``path`` when it is a regular file, never through a symlink (O_NOFOLLOW: a link planted in a
    store could point at a private file); OSError otherwise (ELOOP for a link)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def temp_files(root: Path) -> Iterator[Path]:
    """Temp files of writers, finished or not, in the store's sub-folders."""
    for sub in root.iterdir() if root.is_dir() else ():
        if sub.is_dir() and not sub.name.startswith("."):
            yield from (p for p in sub.glob(f".*{TMP_SUFFIX}") if _TMP.match(p.name))


def sweep_temps(root: Path, locked_final: Path | None = None) -> list[Path]:
    """Remove temp files left by killed writers: those of ``locked_final`` (the caller holds its lock, so no live
    writer owns one), those of this host's processes that are gone, and other hosts' once a day old."""
    removed = []
    for p in temp_files(root):
        m = _TMP.match(p.name)
        if m is None:  # temp_files yields only names _TMP matches
            continue
        if locked_final is not None and p.parent == locked_final.parent and m["final"] == locked_final.name:
            gone = True
        elif m["host"] == _HOST:
            gone = not _pid_alive(int(m["pid"]))
        else:
            try:
                gone = time.time() - p.stat().st_mtime > FOREIGN_TMP_AGE_S
            except FileNotFoundError:
                continue
        if gone:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


@contextlib.contextmanager
def write_lock(root: Path, name: str) -> Iterator[None]:
    """An exclusive flock on ``root/.locks/<name>.lock``, released when the block ends or the process dies. The
    lock file is opened read-only (flock needs no write access), so users of a shared store lock each other's."""
    lock_dir = root / LOCK_DIR
    lock_dir.mkdir(exist_ok=True)
    fd = os.open(lock_dir / f"{name}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
