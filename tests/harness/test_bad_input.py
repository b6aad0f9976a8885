"""Bad input through the CLI (``lpdiff.harness.cli.main``): every case exits 2 with one line naming the file or
argument, what is wrong and the fix, and writes nothing to the baseline store.

Adapters are copies of the committed tiny-zoo adapters with one thing broken, as a user's files would be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lpdiff.harness.cli import main
from lpdiff.harness.spec.resolve import zoo_adapters
from lpdiff.harness.types import LogprobRun, PromptLogprobs

MODEL = "tiny-qwen3-moe"


def copy_adapter(tmp_path: Path, name: str, model: str = MODEL) -> Path:
    dst = tmp_path / f"{model}-{name}"
    shutil.copytree(zoo_adapters(model)[name].path, dst)
    return dst


def edit_tensors(d: Path, fn) -> Path:
    path = d / "adapter_model.safetensors"
    save_file(fn(load_file(str(path))), str(path))
    return d


def edit_config(d: Path, **changes) -> Path:
    path = d / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return d


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def refused(capsys, argv: list[str], *needles: str, store: Path | None = None) -> str:
    """Run the CLI, expect exit 2 and one error line holding every needle, and an untouched store."""
    before = files(store) if store else None
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    if store is not None:
        assert files(store) == before, "the store changed"
    return lines[0]


# -- adapters -------------------------------------------------------------------------------------------------------


def _broken_json(d: Path) -> Path:
    (d / "adapter_config.json").write_text('{ r: 8, "lora_alpha": 16 }')
    return d


def _pickle(d: Path) -> Path:
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")  # never opened: the name says pickle
    return d


def _rank_4_under_r_8(d: Path) -> Path:  # r=8 in the config, rank-4 tensors
    return edit_tensors(
        d, lambda t: {k: v[:4].contiguous() if ".lora_A." in k else v[:, :4].contiguous() for k, v in t.items()}
    )


def _nan_in_b(d: Path) -> Path:
    def f(t):
        k = next(k for k in sorted(t) if ".lora_B." in k)
        t[k][0, 0] = float("nan")
        return t

    return edit_tensors(d, f)


def _no_tensors(d: Path) -> Path:
    return edit_tensors(d, lambda t: {})


def _router_without_tensors(d: Path) -> Path:
    cfg = json.loads((d / "adapter_config.json").read_text())
    return edit_config(d, target_parameters=[*cfg["target_parameters"], "mlp.gate.weight"])


def _wrong_width(d: Path) -> Path:
    return edit_tensors(d, lambda t: {k: torch.cat([v, v], dim=1) if ".lora_A." in k else v for k, v in t.items()})


@pytest.mark.parametrize(
    "adapter, model, breaks, needles",
    [
        ("attention", MODEL, _broken_json, ("adapter_config.json: not valid JSON", "line 1 column 3")),
        ("attention", MODEL, _pickle, ("adapter_model.bin", "lpdiff never unpickles: save the adapter as safetensors")),
        ("attention", MODEL, _rank_4_under_r_8, ("has rank 4 but adapter_config.json says r=8",)),
        ("attention", MODEL, _nan_in_b, ("NaN or Inf", "lora_B")),
        ("attention", MODEL, _no_tensors, ("holds no tensors",)),
        ("experts", MODEL, _router_without_tensors, ("mlp.gate.weight", "no tensors for them")),
        ("attention", MODEL, _wrong_width, ("do not fit this qwen3_moe model",)),
        ("attention", "tiny-gpt-oss", lambda d: d, ("made for Qwen3MoeForCausalLM", "the model is gpt_oss")),
    ],
    ids=["broken-json", "pickle", "rank-vs-r", "nan", "empty", "router-target-no-tensors", "shape", "arch"],
)
def test_bad_adapter_is_refused_before_anything_runs(tmp_path, capsys, adapter, model, breaks, needles):
    bad = breaks(copy_adapter(tmp_path, adapter))
    store = tmp_path / "store"
    store.mkdir()
    line = refused(
        capsys, ["regen", "--model", model, "--adapter", str(bad), "--baselines", str(store)], *needles, store=store
    )
    assert str(bad) in line  # names the adapter's directory or file
    # compare's test adapter goes through the same check
    refused(capsys, ["compare", "--model", model, "--adapter", "attention", "--test-adapter-dir", str(bad)], *needles)


def test_doctor_says_the_same_with_exit_1(tmp_path, capsys):
    bad = _rank_4_under_r_8(copy_adapter(tmp_path, "attention"))
    assert main(["doctor", MODEL, str(bad), "--engine", "hf"]) == 1
    out = capsys.readouterr().out
    assert "all     ERROR    adapter" in out and "has rank 4 but adapter_config.json says r=8" in out
    refused(capsys, ["doctor", MODEL, str(_broken_json(copy_adapter(tmp_path / "j", "attention")))], "not valid JSON")


# -- prompts --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "records, needles",
    [
        ([], ("no prompts",)),
        ([{"token_ids": [5, 7.0, 9]}], ("line 1", "float values", "never rounds")),
        ([{"token_ids": [5, 7]}, {"token_ids": [5, 1024, 3]}], ("line 2", "outside the vocabulary [0, 1024)")),
        ([{"token_ids": [5, -1, 3]}], ("line 1", "outside the vocabulary", "-1")),
        ([{"token_ids": [5]}], ("line 1", "1 token(s)", "at least 2")),
        ([{"token_ids": [5] * 1100}], ("1100 tokens", "max_position_embeddings (1024)", "shorten it")),
    ],
    ids=["empty", "float", "out-of-vocab", "negative", "one-token", "too-long"],
)
def test_bad_prompts_file_is_refused(tmp_path, capsys, records, needles):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    store = tmp_path / "store"
    store.mkdir()
    line = refused(
        capsys,
        ["regen", "--model", MODEL, "--adapter", "attention", "--prompts", str(path), "--baselines", str(store)],
        *needles,
        store=store,
    )
    assert str(path) in line


# -- runs -----------------------------------------------------------------------------------------------------------


def _run(adapter="experts", logprobs=None, topk_ids=None, tokens=(3, 9, 27, 81), model=MODEL) -> LogprobRun:
    n = len(tokens) - 1
    lp = np.full(n, -1.5, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
    ids = np.tile(np.arange(2), (n, 1)) if topk_ids is None else np.asarray(topk_ids)
    p = PromptLogprobs(np.array(tokens), lp, ids, np.full((n, 2), -0.5, np.float32))
    return LogprobRun([p], {"model": model, "adapter": adapter, "engine": "hf", "dtype": "float32"})


@pytest.mark.parametrize(
    "make_b, needles",
    [
        (lambda p: None, ("no such file",)),
        (lambda p: p.write_bytes(b"not a zip at all" * 8), ("not an .npz file", "--save-runs")),
        (lambda p: np.savez(p, token_ids=np.arange(4)), ("no 'lengths', 'logprobs' array(s)", "not a logprob run")),
        (lambda p: _run(logprobs=[-1.0, float("nan"), -2.0]).save(p), ("1 logprob(s) are NaN or Inf", "position 1")),
        (lambda p: _run(logprobs=[-1.0, 0.5, -2.0]).save(p), ("logprob(s) are above 0",)),
        (lambda p: _run(topk_ids=[[0, 1], [0, 5000], [1, 2]]).save(p), ("top-k id(s) are outside [0, 1024)",)),
        (lambda p: _run(adapter="attention").save(p), ("has adapter experts but", "--allow-different")),
        (lambda p: _run(tokens=(3, 9, 27, 80)).save(p), ("score different prompts",)),
    ],
    ids=["missing", "junk", "no-logprobs", "nan", "positive", "topk-id-oov", "other-adapter", "other-prompts"],
)
def test_bad_runs_are_refused(tmp_path, capsys, make_b, needles):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _run().save(a)
    make_b(b)
    line = refused(capsys, ["compare", "--runs", str(a), str(b)], *needles)
    assert "allow_pickle" not in line and "b.npz" in line


def test_allow_different_compares_other_adapters(tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _run().save(a)
    _run(adapter="attention").save(b)
    assert main(["compare", "--runs", str(a), str(b), "--allow-different"]) == 0, capsys.readouterr().err


# -- reference runs -------------------------------------------------------------------------------------------------


def test_regen_refuses_to_store_non_finite_runs(tmp_path, capsys):
    # finite weights so large that the reference's logits overflow: the run holds NaN/Inf and must not be stored
    huge = edit_tensors(
        copy_adapter(tmp_path, "attention"), lambda t: {k: v * 1e30 if ".lora_B." in k else v for k, v in t.items()}
    )
    store = tmp_path / "store"
    store.mkdir()
    refused(
        capsys,
        ["regen", "--model", MODEL, "--adapter", str(huge), "--prompt-set", "short", "--baselines", str(store)],
        "reference runs of tiny-qwen3-moe",
        "NaN or Inf",
        "nothing was stored",
        store=store,
    )
