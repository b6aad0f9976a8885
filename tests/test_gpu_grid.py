"""suites/test_engines_gpu.py's grid, on CPU: which cases `-m gpuN` selects, and the reason each one an engine
cannot serve gives when it skips."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "engines_gpu_grid", Path(__file__).resolve().parents[1] / "suites" / "test_engines_gpu.py")
grid_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid_module)


def test_every_model_engine_and_dtype_at_every_tp_size_carries_its_gpu_mark():
    cases = {}
    for p in grid_module.grid():
        model, engine, tp, dtype = p.values
        assert [m.name for m in p.marks] == [f"gpu{tp}"], p.id
        assert p.id.endswith({"bfloat16": "-bf16", "float32": "-fp32"}[dtype]), p.id
        cases.setdefault(tp, set()).add((model, engine, dtype))
    every = {(m, e, d) for m in grid_module.MODELS for e in grid_module.ENGINES for d in grid_module.DTYPES.values()}
    assert set(cases) == {1, 2, 4, 8}
    assert all(cases[tp] == every for tp in cases)
    assert {m for m, _, _ in every} == {"qwen3-30b-a3b", "gpt-oss-20b", "qwen3.5-35b-a3b", "nemotron-3-nano-30b-a3b",
                                        "nemotron-3-super-120b-a12b"}


@pytest.mark.parametrize("engine,model,tp,dtype,why", [
    ("triton", "qwen3-30b-a3b", 4, "float32", None),
    ("triton", "gpt-oss-20b", 8, "bfloat16", None),
    ("sglang", "nemotron-3-nano-30b-a3b", 4, "bfloat16", None),
    ("vllm", "qwen3.5-35b-a3b", 2, "bfloat16", None),
    ("hf", "qwen3.5-35b-a3b", 1, "bfloat16", None),  # HF's own bf16 rounding, judged like an engine
    ("vllm", "qwen3-30b-a3b", 1, "float32", "vLLM has no float32 LoRA path"),
    ("sglang", "gpt-oss-20b", 2, "float32", "SGLang has no float32 LoRA path"),
    ("triton", "nemotron-3-super-120b-a12b", 1, "bfloat16", "does not serve nemotron_h"),
    ("hf", "gpt-oss-20b", 2, "bfloat16", "runs TP 1 only"),
    ("hf", "gpt-oss-20b", 1, "float32", "is the reference itself"),
])
def test_a_case_an_engine_cannot_serve_skips_with_the_reason(engine, model, tp, dtype, why):
    got = grid_module.cannot_serve(engine, model, tp, dtype)
    assert got is None if why is None else why in got, got
