"""The store under faults: SIGKILL of a writer at random instants, file modes, a store nobody may write to, and
paths that are files where folders belong. Each ends with a readable baseline or one clear BaselineError naming
the path and the fix.

Run the kill loop longer by hand with
``LPDIFF_KILLS=1000 python -m pytest -q tests/harness/pipeline/test_store_durability.py -k kill``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import stat
import time

import numpy as np
import pytest

from lpdiff.harness.pipeline.store import BaselineCorrupt, BaselineStore, BaselineStorePath
from lpdiff.harness.pipeline.store_files import temp_files
from tests.helpers.runs import PROMPTS, assert_same, key, make_run

SHIFTS = (0.0, 1.0, 2.0)  # the versions a writer alternates between: each one is a valid baseline
KEYS = [key(extra={"slot": i}) for i in range(3)]


def _writer(root: str) -> None:
    store, i = BaselineStore(root), 0
    while True:
        store.put(KEYS[i % len(KEYS)], make_run(shift=SHIFTS[i % len(SHIFTS)]), overwrite=True)
        i += 1


def _which_version(store: BaselineStore, k) -> float:
    got = store.get(k)  # raises when the file is torn
    for s in SHIFTS:
        if np.array_equal(got.to_arrays()["logprobs"], make_run(shift=s).to_arrays()["logprobs"]):
            return s
    raise AssertionError(f"{k.digest[:12]} holds none of the versions written")


def test_sigkill_during_put_never_loses_a_baseline(tmp_path):
    kills = int(os.environ.get("LPDIFF_KILLS", "120"))
    store, rng = BaselineStore(tmp_path), random.Random(0)
    for k in KEYS:
        store.put(k, make_run(shift=SHIFTS[0]))
    ctx = mp.get_context("fork")  # the parent has imported everything: a forked writer starts in milliseconds
    seen_temp, t0 = 0, time.monotonic()
    for _ in range(kills):
        proc = ctx.Process(target=_writer, args=(str(tmp_path),), daemon=True)
        proc.start()
        time.sleep(rng.uniform(0.0, 0.04))  # a put takes a few ms: the kill lands anywhere inside one
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        seen_temp += any(True for _ in temp_files(tmp_path))
        for k in KEYS:
            _which_version(store, k)
    elapsed = time.monotonic() - t0
    store.put(KEYS[0], make_run(shift=SHIFTS[1]), overwrite=True)  # the next write sweeps killed writers' temps
    assert list(temp_files(tmp_path)) == []
    assert sorted(p.name for p in tmp_path.glob("??/*")) == sorted(f"{k.digest}.parquet" for k in KEYS)
    print(f"{kills} kills in {elapsed:.1f}s, {seen_temp} left a temp file, every baseline readable")


def test_files_honour_the_umask(tmp_path):
    store = BaselineStore(tmp_path / "store")
    old = os.umask(0o002)  # a group-shared store
    try:
        store.put(KEYS[0], make_run())
    finally:
        os.umask(old)
    old = os.umask(0o022)
    try:
        store.put(KEYS[1], make_run())
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(store.path(KEYS[0])) == 0o664 and mode(store.path(KEYS[1])) == 0o644  # mkstemp would give 0600
    assert mode(store.path(KEYS[0]).parent) & 0o755 == 0o755


def test_reading_writes_nothing_anywhere(tmp_path, monkeypatch):
    """A read-only `lpdiff run` needs no writable path: get / ls / find_stale create no file or folder, neither in
    the store nor in the temp dir (where a lock used to be needed)."""
    import tempfile

    store = BaselineStore(tmp_path / "store")
    store.put(KEYS[0], make_run())
    fake_tmp = tmp_path / "tmp"
    fake_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fake_tmp))
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    real_open = os.open

    def no_writes(path, flags, *a, **kw):
        assert not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT), f"a read opened {path} for writing"
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_writes)
    assert_same(store.get(KEYS[0]), make_run())
    assert [e.key for e in store.ls()] == [KEYS[0]] and store.find_stale(KEYS[1]) == []
    assert store.prune() == []  # a dry run is a read too
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot create anything in: chmod 0555 for a normal user; root ignores modes, so
    there a path under /sys (a kernel filesystem that refuses new entries) stands in."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        yield d / "store"
        d.chmod(0o755)
    else:
        yield __import__("pathlib").Path("/sys/lpdiff-store")


def test_unwritable_store_on_regen_is_one_clear_error(unwritable):
    with pytest.raises(
        BaselineStorePath,
        match=r"cannot write to the baseline store .* pass --baselines \(or "
        r"LPDIFF_BASELINES\) a writable folder",
    ):
        BaselineStore(unwritable).put(KEYS[0], make_run())


def test_store_that_is_a_file(tmp_path):
    f = tmp_path / "baselines.txt"
    f.write_text("not a folder")
    store = BaselineStore(f)
    for action in (lambda: store.get(KEYS[0]), lambda: store.put(KEYS[0], make_run()), store.ls):
        with pytest.raises(BaselineStorePath, match=f"baseline store folder {f} is a file; pass --baselines"):
            action()


def test_file_where_a_subfolder_belongs(tmp_path):
    store = BaselineStore(tmp_path)
    sub = tmp_path / KEYS[0].digest[:2]
    sub.write_text("in the way")
    for action in (lambda: store.get(KEYS[0]), lambda: store.put(KEYS[0], make_run())):
        with pytest.raises(BaselineStorePath, match=f"{sub} is a file; move that file out of the store"):
            action()


@pytest.mark.parametrize("content", [b"", b"junk" * 100, b"PK\x03\x04 a zip, not parquet", b"PAR1" + b"\0" * 64])
def test_junk_file_is_corrupt_naming_path_and_fix(tmp_path, content):
    store = BaselineStore(tmp_path)
    path = store.path(KEYS[0])
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(BaselineCorrupt) as e:
        store.get(KEYS[0])
    msg = str(e.value)
    assert str(path) in msg and "lpdiff regen --model tiny-moe" in msg and "\n" not in msg
    assert "allow_pickle" not in msg
    assert [x.problem is not None for x in store.ls()] == [True]


def test_a_killed_writers_temp_file_goes_with_the_next_write(tmp_path):
    store = BaselineStore(tmp_path)
    store.put(KEYS[0], make_run())
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=os.kill, args=(0, 0))  # any short-lived process: its pid is then dead
    proc.start()
    proc.join()
    folder = store.path(KEYS[1]).parent
    folder.mkdir(exist_ok=True)
    from lpdiff.harness.pipeline import store_files

    orphan = folder / f".{store.path(KEYS[1]).name}.{store_files._HOST}-{proc.pid}-0123abcd.tmp"
    orphan.write_bytes(b"half a file")
    live = folder / f".{store.path(KEYS[2]).name}.{store_files._HOST}-{os.getpid()}-0123abcd.tmp"
    live.write_bytes(b"a live writer's file")
    assert store.get(KEYS[0]) is not None and orphan.exists()  # reading never removes anything
    store.put(KEYS[0], make_run(shift=1.0), overwrite=True)
    assert not orphan.exists() and live.exists()  # a live writer's temp stays
    assert len(PROMPTS) == len(store.get(KEYS[0]).prompts)
