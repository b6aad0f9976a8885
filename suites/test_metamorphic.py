"""Metamorphic (self-consistency) suite: each engine against itself on inputs that must give the same logprobs
(harness/metamorphic.py), judged against its own rerun noise. Every relation that applies must PASS; those that do
not apply are printed as n/a with the reason. ``LPDIFF_METAMORPHIC_CSV=path`` appends the rows to a CSV
(benchmarks/results/metamorphic.csv holds the committed results).

- cpu: the tiny zoo on hf and triton (the vLLM-CPU ones are in tests/engines/vllm/test_metamorphic.py, which the vLLM
  stage runs in its own virtualenv).
- gpu1 / gpu2: 4 layers of Qwen3-30B-A3B and gpt-oss-20b at full width, built on the device, on triton (fp32),
  vLLM and SGLang (bf16: their LoRA kernels have no fp32). Random-init routers have near-ties, so the ratio is taken
  before the first near-tie of each prompt (harness.metamorphic.judge_lanes). vLLM / SGLang run in this interpreter,
  or through LPDIFF_<ENGINE>_PYTHON / LPDIFF_<ENGINE>_PYTHONPATH (lpdiff.harness.pipeline.session.engine_options).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import pytest

from lpdiff.harness.commands import metamorphic as mm
from lpdiff.harness.commands import relations as rel
from lpdiff.harness.pipeline.metrics import near_tie_eps
from lpdiff.harness.pipeline.session import engine_missing, engine_options, engine_required
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.spec.resolve import zoo_adapters

# engine defects a relation exposes on purpose: (engine, arch, lane) -> the defect. Such a lane must FAIL; the day
# it passes the test fails, so that the fix gets recorded
KNOWN_DEFECTS = {
    (
        "vllm",
        "gpt_oss",
        "mode:mixed_moe_lora_format:lora",
    ): "vLLM 0.25.1 adds gpt-oss's expert gate/up LoRA as concatenated halves under enable_mixed_moe_lora_format "
    "(engines/vllm.py; as a reference check: benchmarks/results/engines_gpu.md, forced per-expert session)"
}


def _check(rep: mm.Report, written: bool = False, arch: str = "") -> None:
    """written: the rows already went to LPDIFF_METAMORPHIC_CSV session by session (_csv_writer)."""
    print("\n" + mm.format_report(rep))
    if os.environ.get("LPDIFF_METAMORPHIC_CSV") and not written:
        mm.write_csv(rep, os.environ["LPDIFF_METAMORPHIC_CSV"])
    judged = [r for r in rep.results if r.verdict != "n/a"]
    assert judged, "no relation applied"
    known = {lane: why for (engine, a, lane), why in KNOWN_DEFECTS.items() if engine == rep.engine and a == arch}
    fixed = [f"{r.relation} ({known[r.relation]})" for r in judged if r.relation in known and r.verdict == "PASS"]
    assert not fixed, "known defect no longer reproduced, record the fix: " + "; ".join(fixed)
    failed = [
        f"{r.relation}: ratio {r.ratio:.3g} (max |Δ| {r.max_abs:.3g}, noise {r.rerun_noise:.3g})"
        for r in rep.failed
        if r.relation not in known
    ]
    assert not failed, f"{rep.model}/{rep.adapter} on {rep.engine}: " + "; ".join(failed)


CPU_CASES = [
    # the reference engine on the concatenated-gate/up MoE: formats through lpdiff's per-expert -> PEFT 3D conversion
    # (the hf engine converts before PEFT loads; PEFT's own qwen3_moe conversion is covered only by
    # tests/harness/commands/test_doctor.py), merged weights, its expert kernels as modes
    pytest.param("hf", "tiny-qwen3-moe", "all", ["format", "merged", "zero_b", "modes"], id="hf-qwen3"),
    # our runtime on gpt-oss (interleaved, transposed experts): every relation but the slow ones (merged: another
    # checkpoint; modes: the Triton interpreter) that tests/harness/commands/test_metamorphic.py and the CSV cover;
    # TP 2 over gloo
    pytest.param(
        "triton",
        "tiny-gpt-oss",
        "all",
        ["format", "rank", "factors", "gate_up", "zero_b", "batch", "tp"],
        id="triton-gpt-oss",
    ),
]


@pytest.mark.cpu
@pytest.mark.parametrize("engine,model,adapter,relations", CPU_CASES)
def test_metamorphic_tiny_zoo(engine, model, adapter, relations, tmp_path):
    rep = mm.run_metamorphic(
        engine,
        get_model(model),
        zoo_adapters(model)[adapter].path,
        prompt_set(model),
        adapter_name=adapter,
        relations=relations,
        tmp=tmp_path,
    )
    _check(rep)


# -- GPU --------------------------------------------------------------------------------------------------------------


def _progress(msg: str) -> None:
    # a GPU job's log (pytest -s) shows which set-up step or engine session it is in
    print(f"[metamorphic {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextmanager
def _step(what: str):
    t0 = time.perf_counter()
    yield
    _progress(f"{what}: {time.perf_counter() - t0:.1f} s")


GPU_MODELS = ["qwen3-30b-a3b", "gpt-oss-20b"]
# adapter shapes: both module groups, experts only (no attention delta to hide an expert bug behind), attention
# only (the expert relations are n/a, the rest must hold); LPDIFF_METAMORPHIC_ADAPTERS=a16,... narrows a GPU run
GPU_ADAPTERS = {"a16": ("attention", "experts"), "experts16": ("experts",), "attention16": ("attention",)}
CHOSEN_ADAPTERS = [a for a in os.environ.get("LPDIFF_METAMORPHIC_ADAPTERS", ",".join(GPU_ADAPTERS)).split(",") if a]
GPU_ENGINES = {"triton": "float32", "vllm": "bfloat16", "sglang": "bfloat16"}


@pytest.fixture(scope="module", params=GPU_MODELS)
def gpu_case(request, tmp_path_factory):
    import torch

    from lpdiff.harness.spec.adapters import convert_adapter, generate_adapter
    from lpdiff.harness.spec.catalog import load_hf_model

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    spec = get_model(request.param, num_layers=4)
    root = tmp_path_factory.mktemp(request.param)
    with _step(f"build {spec.name} x4 layers on cuda"):
        model = load_hf_model(spec, torch.float32, "cuda")
    # rank 16 (SGLang needs q and v together: the attention group holds q/k/v/o), each shape in both expert layouts
    # (see _original)
    unknown = [a for a in CHOSEN_ADAPTERS if a not in GPU_ADAPTERS]
    assert not unknown, f"LPDIFF_METAMORPHIC_ADAPTERS names {unknown}; known: {', '.join(GPU_ADAPTERS)}"
    adapters = {}
    for name, groups in ((a, GPU_ADAPTERS[a]) for a in CHOSEN_ADAPTERS):
        with _step(f"generate the rank-16 adapter {name}"):
            a = generate_adapter(model, root / name, groups=groups, rank=16, alpha=32, seed=1)
            layouts = {"peft3d": a.path}
            if "experts" in groups:
                layouts["per_expert"] = convert_adapter(
                    a.path, root / f"{name}-per-expert", "per_expert", model.config
                ).path
            adapters[name] = layouts
    del model
    torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (512, 333, 128, 480, 64, 257)]
    return spec, adapters, prompts


def _original(engine: str, spec, layouts: dict) -> str:
    """The first layout doctor lets this engine read: SGLang 0.5.15 dies on PEFT 3D expert adapters, and vLLM
    0.25.1's PEFT 3D path faults on Qwen3-MoE; both then get the same delta in per-expert keys."""
    for path in layouts.values():
        if rel.refusal(spec, engine, path) is None:
            return path
    pytest.fail(f"doctor refuses the adapter in every layout for {engine} on {spec.name}")


def _csv_writer(engine: str, spec, dtype: str, adapter: str):
    """Each engine session's rows into LPDIFF_METAMORPHIC_CSV as soon as it ends: a GPU job cut by its time limit
    keeps what it measured (one limit hit in a fifth SGLang session would otherwise lose four finished ones)."""
    path = os.environ.get("LPDIFF_METAMORPHIC_CSV")
    if not path:
        return None
    from lpdiff.harness.pipeline.provenance import device_name

    def write(version, results):
        mm.write_csv(mm.Report(engine, version, spec.name, adapter, dtype, 3, results, device_name()), path)

    return write


def _gpu_run(engine, gpu_case, relations, tmp_path, name: str = "a16"):
    spec, adapters, prompts = gpu_case
    dtype = GPU_ENGINES[engine]
    with _step(f"doctor picks the layout {engine} reads"):
        adapter = _original(engine, spec, adapters[name])
    options = engine_options(engine)
    if "python" in options:  # a subprocess lane: an engine that hangs becomes an error carrying its log tail
        options.setdefault("lane_call_timeout_s", 300)
    return mm.run_metamorphic(
        engine,
        spec,
        adapter,
        prompts,
        adapter_name=name,
        dtype=dtype,
        options=options,
        relations=relations,
        k=3,
        near_tie_eps=near_tie_eps(dtype),
        tmp=tmp_path,
        log=_progress,
        on_results=_csv_writer(engine, spec, dtype, name),
    )


@pytest.mark.gpu1
@pytest.mark.parametrize("adapter", CHOSEN_ADAPTERS)
@pytest.mark.parametrize("engine", list(GPU_ENGINES))
def test_metamorphic_full_width(engine, adapter, gpu_case, tmp_path):
    if why := engine_missing(engine):  # a failure where the job named the engine ($LPDIFF_REQUIRE_ENGINES)
        (pytest.fail if engine_required(engine) else pytest.skip)(why)
    # LPDIFF_METAMORPHIC_RELATIONS=format,rank,... narrows a GPU run to what its device time allows
    chosen = os.environ.get("LPDIFF_METAMORPHIC_RELATIONS")
    _check(
        _gpu_run(engine, gpu_case, chosen.split(",") if chosen else list(mm.RELATIONS), tmp_path, adapter),
        written=True,
        arch=gpu_case[0].arch,
    )


@pytest.mark.gpu2
@pytest.mark.parametrize("engine", list(GPU_ENGINES))
def test_metamorphic_tensor_parallel(engine, gpu_case, tmp_path):
    """The tp relation: TP 2 (and TP 4 where four GPUs are visible) against TP 1, each TP session judged with its
    own rerun noise as well as TP 1's."""
    if why := engine_missing(engine):  # a failure where the job named the engine ($LPDIFF_REQUIRE_ENGINES)
        (pytest.fail if engine_required(engine) else pytest.skip)(why)
    rep = _gpu_run(engine, gpu_case, ["tp"], tmp_path)
    assert any(r.relation.startswith("tp:2:") and r.verdict != "n/a" for r in rep.results)
    _check(rep, written=True, arch=gpu_case[0].arch)
