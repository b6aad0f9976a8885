"""Nemotron-H's dense LoRA linears take B packed once when the adapters are stacked and the slot mask once per batch
(nemotron_h_model.NemotronHModel.linear), instead of lora_linear's cublas path rebuilding both on every call: no
packing or one-hot inside a forward, and the logprobs bit for bit those of the per-call path. On the tiny zoo model
(CPU) with impl "triton", the path the GPU runs (its vendor GEMMs are torch's CPU GEMMs here), fp32 and bf16,
several adapters, rows with none, and a one-adapter batch."""

from __future__ import annotations

import importlib
import random

import numpy as np
import pytest

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.triton.engine import TritonEngine
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.types import AdapterSpec
from tests.helpers.paths import REPO

MODEL = "tiny-nemotron-h"
ADAPTERS = ("all", "mamba")
# the module (lpdiff.kernels re-exports its function of the same name)
lora_linear = importlib.import_module(
    "lpdiff.kernels.lora_linear"
)  # "all" adapts the attention and mamba projections, "mamba" the mamba ones only


def _engine(dtype: str) -> TritonEngine:
    ads = {n: AdapterSpec(n, str(REPO / "harness" / "zoo_adapters" / MODEL / n)) for n in ADAPTERS}
    cfg = EngineConfig(model=get_model(MODEL), adapters=ads, dtype=dtype, device="cpu", options={"impl": "triton"})
    return TritonEngine(cfg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_b_and_batch_mask_are_built_once_and_change_no_bit(dtype, monkeypatch):
    rng = random.Random()
    with _engine(dtype) as eng:
        rt = eng.runtime
        linears = [lin for lay in rt.weights.layers for lin in lay.mods.values() if lin.a is not None]
        assert linears and all(lin.b_packed is not None for lin in linears)
        prompts = [[rng.randrange(1, rt.cfg.vocab_size) for _ in range(rng.randint(3, 9))] for _ in range(3)]
        calls = []

        def counted(name, fn):
            def wrapped(*a, **k):
                calls.append(name)
                return fn(*a, **k)

            return wrapped

        batches = ([0, -1, 1], [1, 1, 1])  # several adapters and a base row; one adapter for every row
        monkeypatch.setattr(lora_linear, "pack_lora_b", counted("pack", lora_linear.pack_lora_b))
        monkeypatch.setattr(lora_linear, "slot_one_hot", counted("one_hot", lora_linear.slot_one_hot))
        packed = [rt.run(prompts, slots, 0) for slots in batches]
        assert calls == []  # nothing rebuilt inside a forward
        monkeypatch.undo()
        for lin in linears:  # the per-call path: lora_linear packs B and builds the mask itself
            lin.b_packed = None
        per_call = [rt.run(prompts, slots, 0) for slots in batches]
    for got, want in zip(packed, per_call):
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
