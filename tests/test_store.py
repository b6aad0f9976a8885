"""BaselineStore: exact round trip, clear errors naming the regen command, and concurrent writers."""
import json
import multiprocessing as mp

import numpy as np
import pytest

from lpdiff.harness.pipeline.store import (BaselineCorrupt, BaselineExists, BaselineMissing, BaselineStale, BaselineStore,
                           baseline_key)
from lpdiff.harness.types import AdapterSpec, LogprobRun, ModelSpec, PromptLogprobs

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


def model(seed=0, name="tiny-moe"):
    return ModelSpec(name=name, arch="qwen3_moe", config={"hidden_size": 8}, init_seed=seed, init_recipe="r1")


def make_run(shift=0.0, top_k=2, wall=1.0, prompts=PROMPTS):
    rng = np.random.default_rng(0)
    out = []
    for p in prompts:
        n = len(p)
        out.append(PromptLogprobs(p, -rng.random(n - 1) - shift, rng.integers(0, 10, (n - 1, top_k)),
                                  -rng.random((n - 1, top_k)), rng.random(n)))
    return LogprobRun(out, {"engine": "hf", "wall_s": wall})


def key(**kw):
    args = dict(model=model(), adapter=None, prompts=PROMPTS, dtype="float32", tp=1, engine="hf", top_k=2)
    args.update(kw)
    return baseline_key(**args)


def assert_same(a: LogprobRun, b: LogprobRun):
    xa, xb = a.to_arrays(), b.to_arrays()
    assert xa.keys() == xb.keys()
    for k in xa:
        assert xa[k].dtype == xb[k].dtype and np.array_equal(xa[k], xb[k]), k


def test_key_hashes_content_not_names(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    k = key()
    assert json.loads(k.description) == k.fields and k.fields["dtype"] == "float32" and len(k.digest) == 64
    assert key().digest == k.digest  # deterministic
    assert key(model=model(name="renamed")).digest == k.digest
    variants = [key(model=model(seed=1)), key(adapter=AdapterSpec("a", str(tmp_path))), key(prompts=PROMPTS[:1]),
                key(dtype="bfloat16"), key(tp=2), key(engine="triton"), key(top_k=5), key(extra={"backend": "x"})]
    assert len({v.digest for v in variants} | {k.digest}) == len(variants) + 1


def test_round_trip_is_exact(tmp_path):
    store, k, run = BaselineStore(tmp_path), key(), make_run()
    assert store.put(k, run) is True
    got = store.get(k)
    assert_same(got, run)
    assert got.meta == run.meta
    npz = tmp_path / k.digest[:2] / f"{k.digest}.npz"
    side = json.loads(npz.with_suffix(".json").read_text())
    assert side["key"] == k.fields and side["names"]["model"] == "tiny-moe" and side["meta"]["wall_s"] == 1.0
    assert store.list() == [k]
    assert store.delete(k) and not store.delete(k)
    assert store.list() == [] and not npz.exists()


def test_corrupt_byte_is_detected(tmp_path):
    store, k = BaselineStore(tmp_path), key()
    store.put(k, make_run())
    npz = tmp_path / k.digest[:2] / f"{k.digest}.npz"
    blob = bytearray(npz.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    npz.write_bytes(bytes(blob))
    with pytest.raises(BaselineCorrupt, match="sha256.*lpdiff regen --model tiny-moe .*pytest --lpdiff-regen"):
        store.get(k)


def test_missing_names_the_command(tmp_path):
    with pytest.raises(BaselineMissing) as e:
        BaselineStore(tmp_path).get(key(dtype="bfloat16", tp=2))
    assert "lpdiff regen --model tiny-moe --engine hf --dtype bfloat16 --tp 2 --top-k 2" in str(e.value)
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
    # what a digest collision or a hand-edited sidecar looks like: same file name, other description
    store, k = BaselineStore(tmp_path), key()
    store.put(k, make_run())
    side = tmp_path / k.digest[:2] / f"{k.digest}.json"
    info = json.loads(side.read_text())
    info["key"]["tp"] = 8
    side.write_text(json.dumps(info))
    with pytest.raises(BaselineStale, match="describes another computation"):
        store.get(k)


def test_overwrite_only_when_asked(tmp_path):
    store, k = BaselineStore(tmp_path), key()
    store.put(k, make_run())
    assert store.put(k, make_run(wall=2.0)) is False  # same arrays, other wall time: a no-op
    with pytest.raises(BaselineExists, match="refusing to overwrite.*lpdiff regen"):
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
        except Exception as e:  # a torn read or a broken barrier: report it instead of hanging the test
            results.put((i, f"error {type(e).__name__}: {e}", shift))


@pytest.mark.parametrize("shifts, want", [
    # four workers computing the same reference (pytest -n 4): one writes, three find it already there
    ([0.0] * 4, ["same", "same", "same", "written"]),
    # four workers with different values: exactly one wins, the others are told clearly
    ([0.0, 1.0, 2.0, 3.0], ["exists", "exists", "exists", "written"]),
])
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
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == \
        sorted(f"{d}.{ext}" for d in digests for ext in ("json", "npz"))
