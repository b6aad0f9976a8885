"""BaselineStore: exact round trip through parquet, clear errors naming the regen command, many computations
side by side (prompt sets, depths, engines), explicit prune, and concurrent writers."""

import json
import multiprocessing as mp
import time

import numpy as np
import pytest

from lpdiff.harness.pipeline import store_format
from lpdiff.harness.pipeline.store import BaselineCorrupt, BaselineExists, BaselineMissing, BaselineStale, BaselineStore
from lpdiff.harness.types import AdapterSpec
from tests.helpers.runs import PROMPTS, assert_same, key, make_run, model


def test_key_hashes_content_not_names(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    k = key()
    assert json.loads(k.description) == k.fields and k.fields["dtype"] == "float32" and len(k.digest) == 64
    assert key().digest == k.digest  # deterministic
    assert key(model=model(name="renamed")).digest == k.digest
    variants = [
        key(model=model(seed=1)),
        key(adapter=AdapterSpec("a", str(tmp_path))),
        key(prompts=PROMPTS[:1]),
        key(dtype="bfloat16"),
        key(tp=2),
        key(engine="triton"),
        key(top_k=5),
        key(extra={"backend": "x"}),
    ]
    assert len({v.digest for v in variants} | {k.digest}) == len(variants) + 1


def test_round_trip_is_exact(tmp_path):
    store, k, run = BaselineStore(tmp_path), key(prompt_set="default"), make_run()
    assert store.put(k, run) is True
    got = store.get(k)
    assert_same(got, run)
    assert got.meta == run.meta
    path = tmp_path / k.digest[:2] / f"{k.digest}.parquet"
    assert sorted(
        p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file() and ".locks" not in p.parts
    ) == [path.relative_to(tmp_path).as_posix()]  # one file per baseline
    m = store.manifest(k)
    assert m["key"] == k.fields and m["names"] == {"model": "tiny-moe", "adapter": None, "prompt_set": "default"}
    assert m["meta"]["wall_s"] == 1.0 and m["provenance"]["engine"] == "hf" and m["provenance"]["numpy"]
    assert {"commit", "lpdiff", "python", "pyarrow", "dtype", "tp", "device"} <= m["provenance"].keys()
    assert store.list() == [k]
    assert store.delete(k) and not store.delete(k)
    assert store.list() == [] and not path.exists()


def test_datasets_reads_the_store(tmp_path):
    datasets = pytest.importorskip("datasets")
    store = BaselineStore(tmp_path)
    store.put(key(), make_run())
    store.put(key(top_k=0, engine="triton"), make_run(top_k=None, shift=1.0))  # no top-k: null list columns
    files = sorted(str(p) for p in tmp_path.glob("??/*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / ".hf"))
    assert ds.num_rows == 2 * len(PROMPTS)
    rows = [r for r in ds if r["engine"] == "hf"]
    assert [r["token_ids"] for r in rows] == PROMPTS and rows[0]["model"] == "tiny-moe"
    want = make_run()
    assert np.array_equal(np.asarray(rows[0]["topk_ids"]), want.prompts[0].topk_ids)
    assert np.allclose(rows[1]["logprobs"], want.prompts[1].logprobs)
    assert all(r["topk_ids"] is None and r["router_margin"] is None for r in ds if r["engine"] == "triton")
    assert_same(store.get(key(top_k=0, engine="triton")), make_run(top_k=None, shift=1.0))


def test_corrupt_byte_is_detected(tmp_path):
    store, k = BaselineStore(tmp_path), key()
    store.put(k, make_run())
    path = store.path(k)
    blob = path.read_bytes()
    # data pages, and the manifest in the footer (a flip in the footer's column statistics changes nothing read)
    for where in (len(blob) // 10, len(blob) // 3, blob.index(b'"provenance"') + 3):
        store.put(k, make_run(), overwrite=True)
        blob = bytearray(path.read_bytes())
        blob[where] ^= 0x01
        path.write_bytes(bytes(blob))
        with pytest.raises(BaselineCorrupt, match=f"{path}.*lpdiff regen --model tiny-moe .*pytest --lpdiff-regen"):
            store.get(k)


def test_missing_names_the_command(tmp_path):
    with pytest.raises(BaselineMissing) as e:
        BaselineStore(tmp_path).get(key(dtype="bfloat16", tp=2))
    assert "lpdiff regen --model tiny-moe --reference hf --ref-dtype bfloat16 --tp 2 --top-k 2" in str(e.value)
    assert "pytest --lpdiff-regen" in str(e.value)


def test_stale_when_content_changes_under_the_same_name(tmp_path):
    store = BaselineStore(tmp_path)
    store.put(key(), make_run())
    with pytest.raises(BaselineStale, match=r"model \(.*\) changed.*lpdiff regen --model tiny-moe"):
        store.get(key(model=model(seed=7)))  # same name, other weights
    assert store.find_stale(key(model=model(seed=7))) == [key()]
    with pytest.raises(BaselineMissing):
        store.get(key(engine="triton"))  # another lane is missing, not stale


def test_stale_when_stored_description_differs(tmp_path):
    # what a digest collision or a hand-edited manifest looks like: same file name, other description
    store, k = BaselineStore(tmp_path), key()
    store.put(k, make_run())
    m = store.manifest(k)
    m["key"]["tp"] = 8
    with open(store.path(k), "wb") as fh:
        store_format.write(store_format.encode(make_run(), m), fh)
    with pytest.raises(BaselineStale, match="describes another computation"):
        store.get(k)


def test_overwrite_only_when_asked(tmp_path):
    store, k = BaselineStore(tmp_path), key()
    store.put(k, make_run())
    assert store.put(k, make_run(wall=2.0)) is False  # same arrays, other wall time: a no-op
    with pytest.raises(BaselineExists, match=r"refusing to overwrite.*lpdiff regen"):
        store.put(k, make_run(shift=1.0))
    assert store.put(k, make_run(shift=1.0), overwrite=True) is True
    assert_same(store.get(k), make_run(shift=1.0))


def test_run_must_match_key(tmp_path):
    store = BaselineStore(tmp_path)
    with pytest.raises(ValueError, match="other prompts"):
        store.put(key(), make_run(prompts=[[3, 1, 4, 1, 6], [9, 2, 6]]))
    with pytest.raises(ValueError, match="top_k=2"):
        store.put(key(), make_run(top_k=3))


ROUNDS = 6  # several keys in lockstep, so that a missing lock shows up on most runs, not one in three


def _put_worker(root, shift, barrier, results):
    for i in range(ROUNDS):
        try:
            barrier.wait(timeout=20)  # all workers reach put() together
            written = BaselineStore(root).put(key(extra={"round": i}), make_run(shift=shift))
            results.put((i, "written" if written else "same", shift))
        except BaselineExists:
            results.put((i, "exists", shift))
        except Exception as e:  # noqa: BLE001 (a torn read or a broken barrier: report it, do not hang the test)
            results.put((i, f"error {type(e).__name__}: {e}", shift))


@pytest.mark.parametrize(
    "shifts, want",
    [
        # four workers computing the same reference (pytest -n 4): one writes, three find it already there
        ([0.0] * 4, ["same", "same", "same", "written"]),
        # four workers with different values: exactly one wins, the others are told clearly
        ([0.0, 1.0, 2.0, 3.0], ["exists", "exists", "exists", "written"]),
    ],
)
def test_concurrent_writers(tmp_path, shifts, want):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(len(shifts)), ctx.Queue()
    procs = [ctx.Process(target=_put_worker, args=(str(tmp_path), s, barrier, results)) for s in shifts]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=60) for _ in range(ROUNDS * len(procs))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.terminate()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    store = BaselineStore(tmp_path)
    for i in range(ROUNDS):
        mine = [(o, s) for j, o, s in outcomes if j == i]
        assert sorted(o for o, _ in mine) == want, i
        winner = next(s for o, s in mine if o == "written")
        assert_same(store.get(key(extra={"round": i})), make_run(shift=winner))
    digests = sorted(key(extra={"round": i}).digest for i in range(ROUNDS))
    assert sorted(p.name for p in tmp_path.glob("??/*")) == sorted(f"{d}.parquet" for d in digests)


def test_other_prompt_sets_depths_and_engines_coexist(tmp_path):
    """A regen of another prompt set, depth or reference engine is another computation: it supersedes nothing
    (today's committed baselines survive `lpdiff regen --prompt-set short` and `--num-layers 2`)."""
    store = BaselineStore(tmp_path)
    base = key(prompt_set="default")
    store.put(base, make_run())
    others = {
        key(prompt_set="short", prompts=PROMPTS[:1]): PROMPTS[:1],
        key(model=model(num_layers=2), prompt_set="default"): PROMPTS,
        key(engine="triton", prompt_set="default"): PROMPTS,
        key(prompts=PROMPTS[1:]): PROMPTS[1:],
    }  # a prompt list without a set name
    for k, prompts in others.items():
        assert store.find_stale(k) == [] and store.put(k, make_run(prompts=prompts)) is True
    assert store.prune() == []  # nothing superseded
    assert sorted(k.digest for k in store.list()) == sorted(k.digest for k in [base, *others])
    assert_same(store.get(base), make_run())
    # the same prompt set whose prompts changed: stale, and regen of it leaves the old one for prune
    changed = key(prompt_set="default", prompts=[[3, 1, 4, 1, 5], [9, 2, 7]])
    assert store.find_stale(changed) == [base]
    with pytest.raises(BaselineStale, match=r"prompts .* changed"):
        store.get(changed)
    store.put(changed, make_run(prompts=[[3, 1, 4, 1, 5], [9, 2, 7]]), overwrite=True)
    assert base in store.list()


def test_hint_names_prompt_set_and_depth(tmp_path):
    with pytest.raises(BaselineMissing) as e:
        BaselineStore(tmp_path).get(key(model=model(num_layers=2), prompt_set="short"))
    assert "`lpdiff regen --model tiny-moe --prompt-set short --num-layers 2 --reference hf --ref-dtype float32" in str(
        e.value
    )
    assert "prompt set 'short'" in str(e.value) and "2 layers" in str(e.value)


def test_prune_lists_exactly_what_goes(tmp_path):
    store = BaselineStore(tmp_path)
    old, new, other = key(prompt_set="default"), key(model=model(seed=3), prompt_set="default"), key(tp=2)
    for k in (old, new, other):
        store.put(k, make_run())
        time.sleep(1.01)  # manifests carry creation times to the second
    junk = tmp_path / "ab" / ("ab" + "0" * 62 + ".parquet")
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"not parquet")
    listed = store.ls()
    assert [e.path for e in listed] == sorted(e.path for e in listed) and len(listed) == 4
    assert any("UNREADABLE" in e.describe() for e in listed) and any(
        "prompt set 'default'" in e.describe() for e in listed
    )
    plan = store.prune()  # dry run by default
    assert [e.path for e in plan] == [store.path(old)]  # the junk file is no baseline: listed by scan, never removed
    assert [e.path for e in store.scan()[1]] == [junk]
    assert len(store.ls()) == 4  # a dry run removes nothing
    assert store.prune(dry_run=False) == plan
    assert sorted(k.digest for k in store.list()) == sorted([new.digest, other.digest]) and junk.exists()
    assert [e.key for e in store.prune(keep=[new], dry_run=False)] == [other]
    assert store.list() == [new]


def test_old_npz_store_is_converted_with_its_keys(tmp_path):
    import hashlib

    from lpdiff.harness.pipeline.store_legacy import main as migrate_main

    k, run = key(), make_run()
    folder = tmp_path / k.digest[:2]
    folder.mkdir()
    run.save(folder / f"{k.digest}.npz")
    blob = (folder / f"{k.digest}.npz").read_bytes()
    (folder / f"{k.digest}.json").write_text(
        json.dumps(
            {
                "format": 1,
                "digest": k.digest,
                "key": k.fields,
                "names": {"model": k.model_name, "adapter": None},
                "sha256": hashlib.sha256(blob).hexdigest(),
                "meta": run.meta,
            }
        )
    )
    store = BaselineStore(tmp_path)
    with pytest.raises(BaselineStale, match=r"old .npz format.*store_legacy"):
        store.get(k)
    assert migrate_main([str(tmp_path)]) == 0
    assert_same(store.get(k), run) and store.get(k).meta == run.meta
    assert sorted(p.name for p in folder.iterdir()) == [f"{k.digest}.parquet"]


def test_junk_old_npz_is_refused_without_numpy_advice(tmp_path, capsys):
    import hashlib

    from lpdiff.harness.pipeline.store_legacy import main as migrate_main

    k = key()
    folder = tmp_path / k.digest[:2]
    folder.mkdir()
    (folder / f"{k.digest}.npz").write_bytes(b"junk junk junk")
    (folder / f"{k.digest}.json").write_text(
        json.dumps(
            {
                "digest": k.digest,
                "key": k.fields,
                "names": {"model": k.model_name},
                "sha256": hashlib.sha256(b"junk junk junk").hexdigest(),
            }
        )
    )
    assert migrate_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{folder / k.digest}.json" in err and "not an lpdiff .npz run" in err and "allow_pickle" not in err
