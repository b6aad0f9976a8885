"""Issue 44 items 3 and 5: a store file is trusted for nothing its own manifest says. Forged files (a manifest
claiming a digest its key does not hash to, a key naming other prompts than the data holds, NaN numbers with
fresh checksums, top-k data that lies) never make prune remove a real baseline, are never removed by it, and fail
every read with exit 2 naming the file and ``lpdiff regen``. Real store, real parquet files, real CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lpdiff.harness.cli import main
from lpdiff.harness.pipeline import store_format
from lpdiff.harness.pipeline.store import BaselineCorrupt, BaselineStore
from lpdiff.harness.pipeline.store_key import baseline_key, key_from_manifest
from lpdiff.harness.types import LogprobRun, ModelSpec, PromptLogprobs, canonical_hash
from tests.helpers.paths import REPO
from tests.helpers.runs import engine_like_run

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [9, 2, 6, 5, 3]]
BASELINES = REPO / "baselines"


def _key(seed=0):
    spec = ModelSpec(name="tiny-moe", arch="qwen3_moe", config={"hidden_size": 8}, init_seed=seed, init_recipe="r")
    return baseline_key(spec, None, PROMPTS, "float32", 1, "hf", 2, prompt_set="default")


def _forge(
    store: BaselineStore, manifest: dict, run: LogprobRun, digest: str | None = None, data_sha: bool = True
) -> Path:
    """Write a file as a forger would: any manifest, its checksums recomputed (they prove nothing), at the path
    of ``digest`` (default: the one the manifest claims)."""
    manifest = dict(manifest)
    if data_sha:
        manifest["data_sha256"] = store_format.data_sha256(run)
    path = store.root / (digest or manifest["digest"])[:2] / f"{digest or manifest['digest']}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        store_format.write(store_format.encode(run, manifest), fh)
    return path


def _later(manifest: dict) -> dict:
    return {**manifest, "created": "2999-01-01T00:00:00+00:00"}


def _with(run: LogprobRun, **changes) -> LogprobRun:
    """``run`` with prompt 0's arrays replaced (changes: field -> function of the old array)."""
    p = run.prompts[0]
    fields = {f: getattr(p, f) for f in ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "router_margin")}
    fields.update({f: fn(fields[f].copy()) for f, fn in changes.items()})
    return LogprobRun([PromptLogprobs(**fields), *run.prompts[1:]], dict(run.meta))


def _forgeries(store: BaselineStore, genuine, run):
    """(name, path) of forged files of the genuine baseline's computation, each newer than it."""
    m = _later(store_format.read_manifest(store.path(genuine)))
    other = {**m["key"], "model": {**m["key"]["model"], "init_seed": 7}}
    yield "claims a digest its key does not hash to", _forge(store, {**m, "key": other, "digest": "f" * 64}, run)
    lying = {**m["key"], "prompts": "0" * 64}  # the key names other prompts than the file holds
    yield "names other prompts", _forge(store, {**m, "key": lying, "digest": canonical_hash(lying)}, run)
    nan_key = {**m["key"], "model": {**m["key"]["model"], "init_seed": 8}}
    nan = _with(run, logprobs=lambda a: np.full_like(a, np.nan))
    yield "NaN numbers", _forge(store, {**m, "key": nan_key, "digest": canonical_hash(nan_key)}, nan)


def test_forged_files_never_make_prune_remove_a_real_baseline(tmp_path):
    store = BaselineStore(tmp_path)
    genuine, run = _key(), engine_like_run(PROMPTS)
    store.put(genuine, run)
    forged = dict(_forgeries(store, genuine, run))
    # every forgery names the genuine baseline's computation and is newer: the manifest-only listing believes them
    assert all(e.key is not None and e.key.computation() == genuine.computation() for e in store.ls()), store.ls()
    assert store.prune() == []  # nothing the forgeries claim is believed
    assert store.prune(dry_run=False) == [] and store.path(genuine).exists()
    bad = {e.path: e.problem for e in store.scan()[1]}
    assert sorted(bad) == sorted(forged.values()) and all(p.exists() for p in forged.values())
    assert "does not hash to the digest" in bad[forged["claims a digest its key does not hash to"]]
    assert "other prompts" in bad[forged["names other prompts"]]
    assert "NaN" in bad[forged["NaN numbers"]]
    # a real newer regen of the same computation (the model changed under its name) does supersede it
    newer = _key(seed=1)
    store.put(newer, engine_like_run(PROMPTS, seed=1))
    assert [e.key for e in store.prune()] == [genuine]


def test_prune_cli_lists_the_plan_before_removing(tmp_path, capsys):
    store = BaselineStore(tmp_path)
    old = _key()
    store.put(old, engine_like_run(PROMPTS))
    _forge(store, _later(store_format.read_manifest(store.path(old))) | {"digest": "e" * 64}, engine_like_run(PROMPTS))
    store.put(_key(seed=1), engine_like_run(PROMPTS, seed=1))
    capsys.readouterr()
    assert main(["baselines", "prune", "--yes", "--baselines", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"will remove {store.path(old)}") and not store.path(old).exists()
    assert any(
        line.startswith("kept (not a baseline whose content matches its key") and "e" * 64 in line for line in out
    )


@pytest.mark.parametrize(
    "lie, change, says",
    [
        ("NaN logprob", dict(logprobs=lambda a: np.where(np.arange(len(a)) == 2, np.nan, a)), "NaN or Inf"),
        ("positive logprob", dict(logprobs=lambda a: np.abs(a) + 0.5), "above 0"),
        ("unsorted top-k", dict(topk_logprobs=lambda a: a[:, ::-1]), "not sorted"),
        ("top-k id twice", dict(topk_ids=lambda a: np.repeat(a[:, :1], a.shape[1], 1)), "one token id twice"),
        ("top-k id outside the vocabulary", dict(topk_ids=lambda a: a + 1000), "outside [0, 50)"),
        (
            "actual token disagrees with its top-k entry",
            dict(topk_ids=lambda a: np.stack([a[:, 1], a[:, 0]], 1)),
            "disagree with their top-k entry",
        ),
        ("unlisted token above the k-th", dict(topk_ids=lambda a: a * 0 + np.array([48, 49])), "above the k-th"),
    ],
)
def test_read_side_validation_names_the_file_and_regen(tmp_path, lie, change, says):
    """The same key, forged content with fresh checksums: get() refuses it, naming the file and `lpdiff regen`."""
    store = BaselineStore(tmp_path)
    k = _key()
    run = engine_like_run(PROMPTS)
    if lie in ("actual token disagrees with its top-k entry", "unlisted token above the k-th"):
        run = engine_like_run(PROMPTS, shift=6.0)  # the actual token is the most likely: listed at slot 0
    store.put(k, run)
    path = _forge(store, store_format.read_manifest(store.path(k)), _with(run, **change), digest=k.digest)
    with pytest.raises(BaselineCorrupt) as e:
        store.get(k)
    assert str(path) in str(e.value) and says in str(e.value) and "lpdiff regen" in str(e.value), str(e.value)


def test_forged_nan_baseline_is_exit_2_naming_the_file(tmp_path, capsys):
    """The audit's case: a NaN baseline with valid checksums gave a FAIL (exit 1) naming no file."""
    shutil.copytree(BASELINES, tmp_path / "B", ignore=shutil.ignore_patterns(".*"))
    store = BaselineStore(tmp_path / "B")
    entry = next(
        e
        for e in store.ls()
        if e.key.model_name == "tiny-qwen3-moe"
        and e.key.adapter_name is None
        and e.key.prompt_set == "default"
        and e.key.fields["dtype"] == "float32"
    )
    run, manifest = store_format.read(entry.path)
    _forge(store, manifest, _with(run, logprobs=lambda a: np.full_like(a, np.nan)), digest=entry.key.digest)
    assert key_from_manifest(manifest).digest == entry.key.digest
    capsys.readouterr()
    rc = main(
        [
            "run",
            "--model",
            "tiny-qwen3-moe",
            "--adapter",
            "experts",
            "--engine",
            "hf",
            "--tp",
            "1",
            "--baselines",
            str(tmp_path / "B"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and str(entry.path) in err and "lpdiff regen" in err and "NaN" in err, err
