"""benchmarks/bench_e2e.py's per-piece breakdown calls the runtime's internals (MoeTransformer._linear, route,
experts, attention) directly; run it on CPU on the tiny zoo so that a change of those signatures fails here and not
in a GPU job, where the breakdown would be lost after the timing it followed."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_e2e
from lpdiff.engines.base import EngineConfig
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.resolve import zoo_adapters
from lpdiff.harness.types import AdapterSpec


def _once(fn, **_):  # stands in for triton.testing.do_bench: run the piece once, report 1 ms
    fn()
    return 1.0


@pytest.mark.parametrize(
    "model,impl",
    [
        ("tiny-qwen3-moe", "auto"),  # CPU auto: the torch references
        ("tiny-gpt-oss", "auto"),
        # the GPU's pieces: q|k|v LoRA as extra K (its augmented input buffer), the MoE's unsummed top-k outputs
        ("tiny-qwen3-moe", "triton"),
    ],
)
def test_breakdown_runs_every_piece_on_the_runtime(model, impl):
    from lpdiff.engines.triton import TritonEngine

    spec = get_model(model)
    adapter = zoo_adapters(model)["all"]
    prompts = [list(range(3, 3 + n)) for n in (5, 5)]  # the interpreter (impl triton) pays per token
    with TritonEngine(
        EngineConfig(model=spec, adapters={"a": AdapterSpec("a", adapter.path)}, device="cpu", options={"impl": impl})
    ) as eng:
        rows = bench_e2e.breakdown(eng, prompts, "a", do_bench=_once)
    pieces = {p for p, _ in rows}
    assert {"qkv lora_linear", "o lora_linear", "moe_forward", "attention", "whole forward"} <= pieces
    assert all((p, tag) in rows for p in pieces for tag in ("base", "lora"))


# -- the engine list, the rows and the peers (benchmarks/e2e_peers.py) ---------------------------------------------


def test_engine_list_parsing():
    args = bench_e2e.parse_args(
        [
            "--engines",
            "triton",
            "hf",
            "vllm",
            "sglang",
            "--engine-options",
            'vllm={"llm_kwargs": {"enforce_eager": true}}',
        ]
    )
    assert args.engines == ["triton", "hf", "vllm", "sglang"]
    assert args.engine_options == {"vllm": {"llm_kwargs": {"enforce_eager": True}}}
    assert bench_e2e.parse_args([]).engines == ["triton", "hf"]
    assert bench_e2e.parse_args(["--engines", "triton", "hf", "sglang", "--skip-hf"]).engines == ["triton", "sglang"]
    for bad in (
        ["--engines", "tgi"],
        ["--engine-options", "vllm={not json"],
        ["--engine-options", "hf={}"],
        ["--engine-options", "sglang=[1]"],
    ):
        with pytest.raises(SystemExit) as e:
            bench_e2e.parse_args(bad)
        assert e.value.code == 2, bad


def test_rows_have_every_column_and_an_error_instead_of_a_number():
    args = bench_e2e.parse_args(["--commit", "abc1234"])
    ok = bench_e2e.make_row(args, "gpu", "m", 4096, "r32", "triton", 0.0613, 63.841, 21.04, "{}", 61.3, 55.126)
    assert list(ok) == bench_e2e.COLUMNS
    assert (ok["tokens_per_s"], ok["peak_mem_gb"], ok["startup_s"], ok["call_ms"], ok["gpu_ms"], ok["error"]) == (
        66819,
        63.84,
        21.0,
        61.3,
        55.13,
        "",
    )
    err = bench_e2e.make_row(args, "gpu", "m", 4096, "r32", "sglang", error="LaneDied: engine died")
    assert err["tokens_per_s"] == "" and err["peak_mem_gb"] == "" and err["error"] == "LaneDied: engine died"


def test_old_csv_gets_the_new_columns_empty_and_a_foreign_one_is_refused(tmp_path):
    import csv

    old = bench_e2e.COLUMNS[:11]
    path = tmp_path / "e2e.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(old)
        w.writerow(
            [
                "2026-11-29",
                "7c3cbef",
                "NVIDIA H200",
                "qwen3-30b-a3b",
                4096,
                1,
                "bfloat16",
                "r32",
                "triton",
                66834,
                63.84,
            ]
        )
    f, w = bench_e2e.open_csv(path)
    with f:
        w.writerow(
            bench_e2e.make_row(
                bench_e2e.parse_args([]), "g", "m", 8, "none", "vllm", 1.0, startup_s=80.0, settings='{"a":1}'
            )
        )
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench_e2e.COLUMNS
    assert rows[0]["tokens_per_s"] == "66834" and rows[0]["startup_s"] == "" and rows[0]["settings"] == ""
    assert rows[1]["startup_s"] == "80.0" and rows[1]["settings"] == '{"a":1}' and rows[1]["tokens_per_s"] == "8"
    foreign = tmp_path / "other.csv"
    foreign.write_bytes(b"model,speed\r\nx,1\r\n")
    with pytest.raises(SystemExit) as e:
        bench_e2e.open_csv(foreign)
    assert e.value.code == 2 and foreign.read_bytes() == b"model,speed\r\nx,1\r\n"  # nothing changed


def test_peer_options_run_where_the_harness_runs_the_engine(monkeypatch):
    from benchmarks import e2e_peers

    monkeypatch.delenv("LPDIFF_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("LPDIFF_VLLM_OPTIONS", raising=False)
    monkeypatch.setenv("LPDIFF_VLLM_PYTHONPATH", "/root/vw/vsite")
    assert e2e_peers.peer_options("vllm")["enforce_eager"] is False  # FAST: vLLM's compile + CUDA graphs
    opts = e2e_peers.peer_options("vllm", {"enforce_eager": True})
    assert opts["lane"] == "subprocess" and opts["lane_env"] == {"PYTHONPATH": "/root/vw/vsite"}
    assert opts["enforce_eager"] is True  # the caller's options win over FAST
    assert e2e_peers.peer_options("sglang")["server_args"] == {"disable_cuda_graph": False}
    assert e2e_peers.settings_text(opts, "vllm 0.25.1") == 'vllm 0.25.1; {"enforce_eager":true}'


@pytest.mark.parametrize(
    "engine,model,layout", [("sglang", "tiny-qwen3-moe", "per_expert"), ("vllm", "tiny-gpt-oss", "peft3d")]
)
def test_peer_serves_the_layout_it_reads(engine, model, layout, tmp_path):
    import json

    from benchmarks import e2e_peers

    spec = get_model(model)
    src = zoo_adapters(model)["all"]
    served, why = e2e_peers.served_adapter(engine, spec, AdapterSpec("r", src.path), tmp_path)
    assert why is None and served.name == "r"
    cfg = json.loads((Path(served.path) / "adapter_config.json").read_text())
    assert bool(cfg.get("target_parameters")) == (layout == "peft3d"), cfg  # PEFT 3D experts are parameters


def test_missing_peer_gives_error_rows(monkeypatch, tmp_path):
    import importlib.util

    from benchmarks import e2e_peers

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    for k in ("LPDIFF_SGLANG_PYTHON", "LPDIFF_SGLANG_PYTHONPATH", "LPDIFF_SGLANG_OPTIONS"):
        monkeypatch.delenv(k, raising=False)
    rows = []
    args = bench_e2e.parse_args(["--rank", "4"])
    e2e_peers.bench_peer(
        "sglang",
        get_model("tiny-qwen3-moe"),
        AdapterSpec("r", "/nonexistent"),
        [[1, 2]],
        args,
        tmp_path,
        timed=None,
        row=lambda *a, **kw: rows.append((a, kw)),
        log=lambda *a: None,
    )
    assert [a[:2] for a, _ in rows] == [("none", "sglang"), ("r4", "sglang")]
    assert all("not installed" in kw["error"] and a[2] is None for a, kw in rows)


def test_checkpoint_that_does_not_fit_is_refused_before_it_is_built(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from benchmarks import e2e_peers

    spec = get_model("qwen3-30b-a3b", num_layers=1)  # config-built: its checkpoint is written (~2.4 GB at 1 layer)
    e2e_peers.check_disk(spec, tmp_path / "ckpt")  # fits here
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 1000))  # a full disk
    with pytest.raises(OSError, match="--checkpoint-root on a larger disk"):
        e2e_peers.check_disk(spec, tmp_path / "ckpt")


def test_lora_dropped_only_when_every_logprob_equals_the_base_run():
    import numpy as np

    from benchmarks import e2e_peers
    from lpdiff.harness.types import PromptLogprobs

    rng = np.random.default_rng(3)
    base = [PromptLogprobs(np.arange(n), -rng.random(n - 1).astype(np.float32)) for n in (7, 12)]
    same = [PromptLogprobs(b.token_ids, b.logprobs.copy()) for b in base]
    moved = [PromptLogprobs(b.token_ids, b.logprobs.copy()) for b in base]
    moved[1].logprobs[5] -= 1e-3  # one position of one prompt moved
    assert e2e_peers.lora_dropped(base, same) and not e2e_peers.lora_dropped(base, moved)
