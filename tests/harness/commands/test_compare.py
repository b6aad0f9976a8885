"""harness/commands/compare.py called directly: two stored runs judged against each other (the same numbers PASS,
logprobs moved far beyond fp32 noise FAIL, the lanes named from the runs' meta), a live comparison of HF+PEFT with
itself on the tiny zoo, and the one-adapter rule of --test-adapter-dir. The CLI face is in tests/harness/test_cli.py."""

import random

import pytest

from lpdiff.harness.commands.compare import compare_live, compare_runs
from lpdiff.harness.spec.errors import InputError
from tests.helpers.runs import engine_like_run

META = {"model": "tiny-qwen3-moe", "dtype": "float32", "tp": 1, "adapter": "experts"}


def _save(run, path):
    run.save(path)
    return str(path)


def test_stored_runs_pass_when_equal_and_fail_when_moved(tmp_path):
    rng = random.Random()
    prompts = [[rng.randrange(50) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    seed = rng.randrange(2**31)
    a = _save(engine_like_run(prompts, seed=seed, meta={**META, "engine": "triton"}), tmp_path / "a.npz")
    same = _save(engine_like_run(prompts, seed=seed, meta={**META, "engine": "hf"}), tmp_path / "b.npz")
    moved = _save(engine_like_run(prompts, seed=seed, shift=0.5, meta={**META, "engine": "hf"}), tmp_path / "c.npz")
    ok = compare_runs(a, same)
    assert ok.passed and ok.engine_pair == "triton:float32-vs-hf:float32" and ok.model == "tiny-qwen3-moe"
    bad = compare_runs(a, moved)
    assert not bad.passed and bad.reasons


def test_a_broken_copy_needs_exactly_one_adapter(tmp_path):
    with pytest.raises(InputError, match="exactly one --adapter"):
        compare_live("tiny-qwen3-moe", "hf", "float32", "hf", "float32", test_adapter_dir=str(tmp_path))


def test_live_hf_against_itself_passes():
    verdicts = compare_live("tiny-qwen3-moe", "hf", "float32", "hf", "float32", adapter="experts")
    assert verdicts and all(v.passed for v in verdicts)
    assert {v.adapter for v in verdicts} >= {"experts"}
