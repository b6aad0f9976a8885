"""The triton engine's dense LoRA layers (q|k|v and o) on lora_linear's cublas path (B packed once per layer, the
slot mask once per batch, no mask when every prompt uses one adapter), on CPU.

test_triton_engine.py runs its TP=2 test on impl "auto", which on CPU is the torch reference of every kernel, so
this file is where the engine's cublas path meets tensor parallelism (o row-parallel: each rank expands its
partial shrink with the whole packed B, and the all-reduce sums the partial deltas) and one-adapter batches.
"""
from __future__ import annotations

import pytest
import torch

from engines.base import EngineConfig
from tests import test_triton_engine as engine_tests
from tests.test_triton_engine import TOL, _maxdiff

tiny = engine_tests.tiny  # the tiny-model fixture (module scope), built again for this module


def test_batch_knows_the_uniform_slot_and_caches_the_slot_mask():
    from transformers import AutoConfig

    from engines.triton.batch import Batch
    from engines.triton.config import model_config

    cfg = model_config(AutoConfig.for_model("qwen3_moe", **engine_tests.ARCHS["qwen3_moe"]))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    def build(slots):
        return Batch.build(prompts, slots, cfg, torch.float32, torch.device("cpu"))

    assert build([1, 1, 1]).uniform_slot == 1
    # mixed slots, a prompt without an adapter, or none at all: the mask path (or no LoRA)
    assert build([1, 0, 1]).uniform_slot is None
    assert build([1, -1, 1]).uniform_slot is None
    assert build([-1, -1, -1]).uniform_slot is None and build([-1, -1, -1]).token_adapter is None
    b = build([2, -1, 0])
    m = b.slot_mask(3, torch.float32)
    want = torch.tensor([[0, 0, 1]] * 3 + [[0, 0, 0]] * 2 + [[1, 0, 0]] * 4, dtype=torch.float32)
    assert torch.equal(m, want)
    assert b.slot_mask(3, torch.float32) is m  # one build per batch, shared by every layer


@pytest.mark.parametrize("tiny", ["qwen3_moe"], indirect=True)  # one arch: TP workers run the interpreter
def test_cublas_dense_lora_tp2_equals_torch_reference(tiny):
    """TP=2 on the Triton impl (dense LoRA on the cublas path, experts on the interpreted kernels) against the
    TP=1 torch reference: a mixed batch (slot mask) and a one-adapter batch (uniform slot), attention adapters."""
    from engines.triton import TritonEngine

    spec, adapters, prompts = tiny
    short = [p[:10] for p in prompts]  # the interpreter's cost grows with the grid
    choices = [["attn_experts", None, "shared_outer", "attn_experts", None], "shared_outer"]

    def run(tp, impl):
        cfg = EngineConfig(model=spec, adapters=adapters["triton"], dtype="float32", device="cpu", tp=tp,
                           options={"impl": impl})
        with TritonEngine(cfg) as eng:
            return [eng.prompt_logprobs(short, c) for c in choices]

    ref, got = run(1, "torch"), run(2, "triton")
    for c, g, r in zip(choices, got, ref):
        assert _maxdiff(g, r) <= TOL, f"adapter choice {c}"
