"""The Hub baseline backend driven through the real huggingface_hub client against tests/helpers/hub_server.py.

Each scenario runs in a subprocess so that HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE are set before huggingface_hub
is imported, as in a CI job; HF_HUB_DISABLE_XET=1 makes the client upload through git-LFS (see hub_server.py).
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.hub_server import HubServer
from tests.helpers.paths import REPO as CHECKOUT

REPO = "lpdiff-ci/baselines"
URL = f"hf://datasets/{REPO}"
BASELINES = CHECKOUT / "baselines"

_SCRIPT = """
import json, sys
from lpdiff.harness.pipeline import hub
args = json.loads(sys.argv[1])
try:
    op = args.pop("op")
    if op == "push":
        r = hub.push(args["store"], args["url"], lock=args["lock"], parent=args.get("parent"),
                     **({"delete": True} if args.get("delete") else {}))
        out = {"commit": r.ref.revision, "added": r.added, "deleted": r.deleted}
    elif op == "upload":  # another tool's commit of arbitrary files, straight through huggingface_hub
        from huggingface_hub import CommitOperationAdd, HfApi
        api = HfApi()
        api.create_repo(args["repo"], repo_type="dataset", exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=bytes.fromhex(h)) for p, h in args["files"].items()]
        out = {"commit": api.create_commit(args["repo"], ops, commit_message="raw", repo_type="dataset").oid}
    elif op == "pull":
        r = hub.pull(args["url"], lock=args["lock"], update_lock=True)
        out = {"commit": r.ref.revision, "path": str(r.path)}
    elif op == "diff":
        d = hub.diff(args["url"], args["rev1"], args["rev2"])
        out = {"added": d.added, "removed": d.removed, "changed": d.changed}
    elif op == "ls":
        out = {"entries": hub.ls(args["url"], lock=args["lock"])}
    elif op == "datasets":
        import datasets
        ds = datasets.load_dataset("parquet", data_files=args["files"], split="train")
        card = datasets.load_dataset(args["dir"], split="train")  # through the card's configs/data_files
        out = {"rows": ds.num_rows, "columns": ds.column_names, "card_rows": card.num_rows}
except hub.HubError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
    sys.exit(2)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def server():
    with HubServer() as s:
        yield s


@pytest.fixture()
def env(server, tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    e.update(
        HF_ENDPOINT=server.endpoint,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
    )
    return e


def run(env: dict, offline: bool = False, expect_rc: int = 0, **args) -> dict:
    e = dict(env, HF_HUB_OFFLINE="1" if offline else "0")
    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(args)],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == expect_rc, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _fresh_repo(server, name: str) -> str:
    return f"hf://datasets/lpdiff-ci/{name}"


def _tree_equal(a: Path, b: Path) -> list[str]:
    """Relative paths of files that differ or exist on one side only (README.md / dot-files of b ignored)."""
    fa = {p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file() and not p.name.startswith(".")}
    fb = {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() or p.is_symlink()}
    fb = {r for r in fb if r != "README.md" and not r.startswith(".")}
    bad = sorted(fa ^ fb)
    bad += [r for r in sorted(fa & fb) if not filecmp.cmp(a / r, b / r, shallow=False)]
    return bad


def _rewrite(path: Path, compression: str = "none") -> None:
    """Change a baseline file's bytes and keep it valid (same manifest and numbers): parquet re-encoded."""
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(path), path, compression=compression)


def test_url_and_lock(tmp_path):
    from lpdiff.harness.pipeline import hub

    assert hub.parse_url("hf://datasets/org/name@" + "a" * 40) == hub.HubRef("org/name", "a" * 40)
    assert hub.parse_url("hf://datasets/org/name").revision is None
    for bad in ("hf://models/org/name", "hf://datasets/name", "datasets/org/name", "hf://datasets/o/n@"):
        with pytest.raises(hub.HubError, match="hf://datasets/ORG/NAME"):
            hub.parse_url(bad)
    lock = tmp_path / "baselines.lock"
    assert hub.read_lock(lock) is None
    hub.write_lock(lock, hub.HubRef("org/name", "b" * 40))
    assert hub.read_lock(lock) == hub.HubRef("org/name", "b" * 40)
    assert [ln for ln in lock.read_text().splitlines() if not ln.startswith("#")] == [
        f"hf://datasets/org/name@{'b' * 40}"
    ]
    lock.write_text("hf://datasets/org/name@main\n")
    with pytest.raises(hub.HubError, match="40-hex commit"):
        hub.read_lock(lock)


def test_env_read_at_call_time(monkeypatch, tmp_path):
    from lpdiff.harness.pipeline import hub

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as if imported online; restored after the test
    e = hub.HubEnv.from_environ()
    assert e == hub.HubEnv("http://127.0.0.1:9", True, tmp_path / "hub")
    # offline and no commit hash: refused before any request, naming the fix
    with pytest.raises(hub.HubError, match="needs a 40-hex commit"):
        hub.pull("hf://datasets/org/name@main", lock=None)
    # offline with a hash that is not cached: a clear error, and huggingface_hub's own flag was synced
    with pytest.raises(hub.HubError, match="not in the HF cache"):
        hub.pull(f"hf://datasets/org/name@{'c' * 40}", lock=None)
    assert constants.HF_HUB_OFFLINE is True


def test_round_trip_conflict_offline_and_diff(server, env, tmp_path):
    """push -> pull by revision byte-identical; a second writer on a stale parent is refused; a pull with
    HF_HUB_OFFLINE=1 is served from the cache; diff names the changed entry; datasets reads the parquet files."""
    store = tmp_path / "store"
    shutil.copytree(BASELINES, store, ignore=shutil.ignore_patterns(".*"))  # a dev checkout's .locks/ stays home
    lock = tmp_path / "baselines.lock"
    url = _fresh_repo(server, "round-trip")
    first = run(env, op="push", store=str(store), url=url, lock=str(lock))
    files = [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(first["added"]) == len(files) > 0
    assert f"{url}@{first['commit']}" in lock.read_text()
    posts = [r for r in server.state.requests if r.startswith("POST /api/datasets/lpdiff-ci/round-trip/commit/")]
    assert len(posts) == 1  # every file and the card in ONE commit

    got = run(env, op="pull", url=f"{url}@{first['commit']}", lock=str(tmp_path / "other.lock"))
    assert got["commit"] == first["commit"]
    snap = Path(got["path"])
    assert _tree_equal(store, snap) == []
    listed = run(env, op="ls", url=url, lock=str(tmp_path / "other.lock"))["entries"]  # the lock's commit
    assert len(listed) == len([f for f in files if f.suffix in (".parquet", ".json")])
    card = (snap / "README.md").read_text()
    assert card.startswith("---\n") and "tiny-gpt-oss" in card

    # a second writer changes one entry and pushes on the first commit
    writer2 = tmp_path / "writer2"
    shutil.copytree(store, writer2)
    changed = min(p for p in writer2.rglob("*") if p.is_file() and not p.name.startswith("."))
    _rewrite(changed)
    second = run(env, op="push", store=str(writer2), url=url, lock=str(tmp_path / "w2.lock"), parent=first["commit"])
    assert second["added"] == [changed.relative_to(writer2).as_posix()]
    # the first writer, still on the first commit, changed the same file otherwise: refused, told how to recover
    _rewrite(store / changed.relative_to(writer2), compression="gzip")
    err = run(env, op="push", store=str(store), url=url, lock=str(lock), expect_rc=2)
    assert err["error"] == "HubConflict" and "lpdiff baselines pull" in err["message"]
    assert f"{url}@{first['commit']}" in lock.read_text()  # the lock still names what was really pushed

    # offline, by commit hash: served from the cache; a revision never pulled is a clear error
    hits = len(server.state.requests)
    off = run(env, offline=True, op="pull", url=f"{url}@{first['commit']}", lock=str(tmp_path / "off.lock"))
    assert off["path"] == got["path"] and len(server.state.requests) == hits
    miss = run(
        env, offline=True, op="pull", url=f"{url}@{second['commit']}", lock=str(tmp_path / "off.lock"), expect_rc=2
    )
    assert "not in the HF cache" in miss["message"] and "HF_HUB_OFFLINE" in miss["message"]

    d = run(env, op="diff", url=url, rev1=first["commit"], rev2=second["commit"])
    entry = changed.relative_to(writer2).as_posix().split(".")[0]
    assert d == {"added": [], "removed": [], "changed": [entry]}

    parquet = sorted(str(p) for p in snap.rglob("*.parquet"))
    if not parquet:
        pytest.skip("the committed baselines hold no parquet files yet: datasets.load_dataset not exercised")
    rows = run(env, op="datasets", files=parquet, dir=str(snap))
    assert rows["rows"] > 0 and "logprobs" in rows["columns"] and rows["card_rows"] == rows["rows"]


def test_corrupt_download_detected(server, env, tmp_path):
    """A dataset written by another tool (an LFS file and a regular one): a corrupt download of either is caught."""
    store = tmp_path / "store"
    (store / "ab").mkdir(parents=True)
    (store / "ab" / "run.npz").write_bytes(bytes(range(256)) * 40)  # binary: an LFS file
    (store / "ab" / "run.json").write_text('{"key": {"engine": "hf"}}')  # text: a regular file
    url = _fresh_repo(server, "corrupt")
    files = {rel: (store / rel).read_bytes().hex() for rel in ("ab/run.npz", "ab/run.json")}
    pushed = run(env, op="upload", repo="lpdiff-ci/corrupt", files=files)
    for rel in ("ab/run.npz", "ab/run.json"):
        server.state.corrupt = {rel}
        home = tmp_path / f"home-{rel.replace('/', '_')}"
        e = dict(env, HF_HOME=str(home))
        err = run(e, op="pull", url=f"{url}@{pushed['commit']}", lock=str(tmp_path / "l2"), expect_rc=2)
        assert rel in err["message"] and "corrupt" in err["message"] and "pull" in err["message"]
        server.state.corrupt = set()
        ok = run(e, op="pull", url=f"{url}@{pushed['commit']}", lock=str(tmp_path / "l2"))  # the retry heals it
        assert _tree_equal(store, Path(ok["path"])) == []
    lfs_uploads = [r for r in server.state.requests if r.startswith("PUT /lfs-upload/")]
    assert lfs_uploads, "the binary file should have gone through the LFS batch API"


def test_card_front_matter_lists_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    import yaml

    from lpdiff.harness.pipeline import hub_card

    for i, model in enumerate(("m1", "m2")):
        manifest = {
            "key": {"engine": "hf", "dtype": "float32", "tp": 1, "prompts": "abc" * 20},
            "names": {"model": model, "adapter": None, "prompt_set": "short"},
        }
        t = pa.table({"logprobs": [[0.1, 0.2]]}).replace_schema_metadata({b"m": json.dumps(manifest).encode()})
        (tmp_path / f"{i:02d}").mkdir()
        pq.write_table(t, tmp_path / f"{i:02d}" / f"run{i}.parquet")
    card = hub_card.dataset_card(tmp_path, "org/name")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["configs"] == [
        {"config_name": "default", "data_files": [{"split": "train", "path": ["00/run0.parquet", "01/run1.parquet"]}]}
    ]
    assert "| m1 | - | hf | float32 | 1 | short | 00/run0.parquet |" in card


def _lpdiff(env: dict, *argv: str, offline: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess:
    e = dict(env, HF_HUB_OFFLINE="1" if offline else "0")
    return subprocess.run(
        [sys.executable, "-m", "lpdiff.harness.cli", *argv],
        env=e,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
    )


def test_cli_push_pull_then_run_offline_from_the_hub_cache(server, env, tmp_path):
    """The user's path end to end through the CLI: `lpdiff baselines push` of the zoo baselines, `lpdiff baselines
    pull` pins the revision in baselines.lock, and `lpdiff run --baselines hf://...@REV` with HF_HUB_OFFLINE=1
    judges against the cached snapshot (exit 0) without a single request to the server."""
    store = tmp_path / "store"
    shutil.copytree(BASELINES, store, ignore=shutil.ignore_patterns(".*"))
    url = _fresh_repo(server, "cli")
    pushed = _lpdiff(env, "baselines", "push", url, "--baselines", str(store), cwd=tmp_path)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    commit = pushed.stdout.split("@", 1)[1].split(":", 1)[0]
    assert len(commit) == 40 and commit in (tmp_path / "baselines.lock").read_text()
    pulled = _lpdiff(env, "baselines", "pull", f"{url}@{commit}", cwd=tmp_path)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    hits = len(server.state.requests)
    ran = _lpdiff(
        env,
        "run",
        "--model",
        "tiny-qwen3-moe",
        "--engine",
        "hf",
        "--baselines",
        f"{url}@{commit}",
        offline=True,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "PASS" in ran.stdout and "FAIL" not in ran.stdout and len(server.state.requests) == hits
    # a revision that was never pulled cannot be served offline: one clear error, exit 2
    missing = _lpdiff(
        env, "run", "--model", "tiny-qwen3-moe", "--baselines", f"{url}@{'0' * 40}", offline=True, cwd=tmp_path
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr


# -- integrity (issue 44): what a push uploads, and what it can never remove --------------------------------------
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


def _baselines(root: Path, tags) -> list[str]:
    """One real baseline per tag (another computation each) in the store ``root``; their store paths."""
    from lpdiff.harness.pipeline.store import BaselineStore
    from lpdiff.harness.pipeline.store_key import baseline_key
    from lpdiff.harness.types import ModelSpec
    from tests.helpers.runs import engine_like_run

    store, out = BaselineStore(root), []
    spec = ModelSpec(name="m", arch="qwen3_moe", config={"hidden_size": 8}, init_seed=0, init_recipe="r1")
    for i, tag in enumerate(tags):
        k = baseline_key(spec, None, PROMPTS, "float32", 1, "hf", 2, extra={"tag": tag})
        store.put(k, engine_like_run(PROMPTS, seed=i))
        out.append(store.path(k).relative_to(root).as_posix())
    return out


def _head_files(server, repo: str) -> dict[str, bytes]:
    r = server.state.repos[repo]
    return {p: f.data for p, f in r.commits[r.head].items()}


def test_push_uploads_only_the_store_index_never_a_stray_or_a_link(server, env, tmp_path):
    store = tmp_path / "store"
    good = _baselines(store, ["a", "b"])
    secret = tmp_path / "private" / "id_rsa"
    secret.parent.mkdir()
    secret.write_bytes(b"-----BEGIN PRIVATE KEY----- lpdiff-must-not-upload-this")
    (store / "notes.txt").write_text("my notes")
    link = store / "ab" / ("ab" + "1" * 62 + ".parquet")  # named like a baseline, pointing at a private file
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(secret)
    elsewhere = tmp_path / "copy.parquet"
    shutil.copy(store / good[0], elsewhere)
    alias = store / good[1].split("/")[0] / "notes.parquet"  # a link to a valid baseline is no baseline either
    alias.symlink_to(elsewhere)
    folder = store / "cd"  # a linked folder is not walked into
    folder.symlink_to(secret.parent, target_is_directory=True)
    url = _fresh_repo(server, "strays")
    err = run(env, op="push", store=str(store), url=url, lock=str(tmp_path / "l"), expect_rc=2)
    for name in ("notes.txt", link.name, "notes.parquet", str(folder)):
        assert name in err["message"], err
    assert "symlink" in err["message"] and "lpdiff-ci/strays" not in server.state.repos  # nothing was sent
    assert not any(b"lpdiff-must-not-upload-this" in d for d in server.state.lfs.values())
    for p in (store / "notes.txt", link, alias, folder):
        p.unlink()
    pushed = run(env, op="push", store=str(store), url=url, lock=str(tmp_path / "l"))
    assert sorted(pushed["added"]) == sorted(good)
    head = _head_files(server, "lpdiff-ci/strays")
    assert sorted(set(head) - {"README.md", ".gitattributes"}) == sorted(good)
    assert all(head[rel] == (store / rel).read_bytes() for rel in good)


_PUSHER = """
import json, sys
from lpdiff.harness.pipeline import hub
r = hub.push(sys.argv[1], sys.argv[2], lock=sys.argv[3])
print(json.dumps({"commit": r.ref.revision, "added": r.added, "deleted": r.deleted, "base": r.base}))
"""


def test_racing_pushes_with_one_lock_never_revert_each_other(server, env, tmp_path):
    """Three stores, each the first push's baseline plus one of its own, pushed at once with one shared lock file
    (the audit's race: a push based on a lock another push had moved removed that push's file, "1 deleted", exit
    0). Every push succeeds, none deletes anything, and the head holds every store's baseline."""
    first = tmp_path / "first"
    common = _baselines(first, ["common"])
    url, lock = _fresh_repo(server, "race"), tmp_path / "baselines.lock"
    run(env, op="push", store=str(first), url=url, lock=str(lock))
    own = {}
    for i in range(3):
        shutil.copytree(first, tmp_path / f"s{i}", ignore=shutil.ignore_patterns(".*"))
        own[i] = _baselines(tmp_path / f"s{i}", [f"own-{i}"])[0]
    e = dict(env, HF_HUB_OFFLINE="0")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PUSHER, str(tmp_path / f"s{i}"), url, str(lock)],
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in own
    ]
    results = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    assert all(rc == 0 for _, _, rc in results), results
    outs = [json.loads(o.strip().splitlines()[-1]) for o, _, _ in results]
    assert all(o["deleted"] == [] for o in outs)
    head = _head_files(server, "lpdiff-ci/race")
    assert set(common) | set(own.values()) <= set(head), sorted(head)
    # the sequential form of the race: a store without the others' files pushes on the lock they moved
    late = tmp_path / "late"
    shutil.copytree(first, late, ignore=shutil.ignore_patterns(".*"))
    _baselines(late, ["late"])
    out = run(env, op="push", store=str(late), url=url, lock=str(lock))
    assert out["deleted"] == [] and set(own.values()) <= set(_head_files(server, "lpdiff-ci/race"))


def test_push_delete_only_on_the_head_the_store_was_based_on(server, env, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    mine = _baselines(a, ["x", "y"])
    shutil.copytree(a, b, ignore=shutil.ignore_patterns(".*"))
    url, lock_a, lock_b = _fresh_repo(server, "delete"), tmp_path / "a.lock", tmp_path / "b.lock"
    c0 = run(env, op="push", store=str(a), url=url, lock=str(lock_a))["commit"]
    shutil.copy(lock_a, lock_b)
    theirs = _baselines(b, ["z"])[0]
    run(env, op="push", store=str(b), url=url, lock=str(lock_b))  # the head moves past a's base
    (a / mine[1]).unlink()
    err = run(env, op="push", store=str(a), url=url, lock=str(lock_a), delete=True, expect_rc=2)
    assert err["error"] == "HubConflict" and "lpdiff baselines pull" in err["message"]
    assert {mine[1], theirs} <= set(_head_files(server, "lpdiff-ci/delete"))
    run(env, op="pull", url=f"{url}@main", lock=str(lock_a))  # re-based on the head: now --delete mirrors this store
    out = run(env, op="push", store=str(a), url=url, lock=str(lock_a), delete=True)
    assert sorted(out["deleted"]) == sorted([mine[1], theirs]) and out["commit"] != c0
    assert sorted(set(_head_files(server, "lpdiff-ci/delete")) - {"README.md", ".gitattributes"}) == [mine[0]]


def test_lock_pinning_another_repo_or_not_utf8_is_refused_naming_it(tmp_path, monkeypatch):
    from lpdiff.harness.pipeline import hub

    env = hub.HubEnv("http://127.0.0.1:9", False, tmp_path / "cache")  # refused before any request
    lock = tmp_path / "baselines.lock"
    hub.write_lock(lock, hub.HubRef("org/other", "b" * 40))
    for call in (
        lambda: hub.pull("hf://datasets/org/name", lock=lock, env=env),
        lambda: hub.push(tmp_path / "store", "hf://datasets/org/name", lock=lock, env=env),
    ):
        (tmp_path / "store").mkdir(exist_ok=True)
        with pytest.raises(hub.HubError, match=rf"{lock} pins hf://datasets/org/other@b+, not hf://datasets/org/name"):
            call()
    lock.write_bytes(b"hf://datasets/org/name@caf\xe9\n")
    with pytest.raises(hub.HubError, match=rf"{lock} is not a readable UTF-8 text file"):
        hub.read_lock(lock)
