"""benchmarks/bench_e2e.py's per-piece breakdown calls the runtime's internals (MoeTransformer._linear, route,
experts, attention) directly; run it on CPU on the tiny zoo so that a change of those signatures fails here and not
in a GPU job, where the breakdown would be lost after the timing it followed."""
from __future__ import annotations

import pytest

from lpdiff.engines.base import EngineConfig
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.resolve import zoo_adapters
from lpdiff.harness.types import AdapterSpec

from benchmarks import bench_e2e


def _once(fn, **_):  # stands in for triton.testing.do_bench: run the piece once, report 1 ms
    fn()
    return 1.0


@pytest.mark.parametrize("model,impl", [
    ("tiny-qwen3-moe", "auto"),  # CPU auto: the torch references
    ("tiny-gpt-oss", "auto"),
    # the GPU's pieces: q|k|v LoRA as extra K (its augmented input buffer), the MoE's unsummed top-k outputs
    ("tiny-qwen3-moe", "triton"),
])
def test_breakdown_runs_every_piece_on_the_runtime(model, impl):
    from lpdiff.engines.triton import TritonEngine

    spec = get_model(model)
    adapter = zoo_adapters(model)["all"]
    prompts = [list(range(3, 3 + n)) for n in (5, 5)]  # the interpreter (impl triton) pays per token
    with TritonEngine(EngineConfig(model=spec, adapters={"a": AdapterSpec("a", adapter.path)}, device="cpu",
                                   options={"impl": impl})) as eng:
        rows = bench_e2e.breakdown(eng, prompts, "a", do_bench=_once)
    pieces = {p for p, _ in rows}
    assert {"qkv lora_linear", "o lora_linear", "moe_forward", "attention", "whole forward"} <= pieces
    assert all((p, tag) in rows for p in pieces for tag in ("base", "lora"))
