"""The triton engine's dense LoRA layers on CPU: o on lora_linear's cublas path (B packed once per layer, the slot
mask once per batch, no mask when every prompt uses one adapter), q|k|v as extra K columns of the base GEMM
(lora_linear_aug, fed by the input norm), and at TP 1 the MoE's top-k sum fused into the next norm.

tests/engines/triton/test_engine.py runs its TP=2 test on impl "auto", which on CPU is the torch reference of every
kernel, so this file is where those paths meet tensor parallelism (o row-parallel: each rank expands its partial shrink
with the whole packed B, and the all-reduce sums the partial deltas; q|k|v's W_aug sharded by rows; the top-k sum before
the all-reduce), one-adapter batches, HF+PEFT at TP 1, and the runtime's own kernels under the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lpdiff.engines.base import EngineConfig
from tests.helpers.paths import REPO
from tests.helpers.triton_tiny import ARCHS, TOL, maxdiff


def test_batch_knows_the_uniform_slot_and_caches_the_slot_mask():
    from transformers import AutoConfig

    from lpdiff.engines.triton.archs import model_config
    from lpdiff.engines.triton.batch import Batch

    cfg = model_config(AutoConfig.for_model("qwen3_moe", **ARCHS["qwen3_moe"]))
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


# slow: 40 s on CI's 2 loaded cores, all of it the Triton interpreter running the MoE kernels in both TP workers
@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["qwen3_moe"], indirect=True)  # one arch: TP workers run the interpreter
def test_cublas_dense_lora_tp2_equals_torch_reference(tiny):
    """TP=2 on the Triton impl (dense LoRA on the cublas path, experts on the interpreted kernels) against the
    TP=1 torch reference: a mixed batch (slot mask) and a one-adapter batch (uniform slot), attention adapters."""
    from lpdiff.engines.triton import TritonEngine

    spec, adapters, prompts = tiny
    short = [p[:10] for p in prompts]  # the interpreter's cost grows with the grid
    choices = [["attn_experts", None, "shared_outer", "attn_experts", None], "shared_outer"]

    def run(tp, impl):
        cfg = EngineConfig(
            model=spec, adapters=adapters["triton"], dtype="float32", device="cpu", tp=tp, options={"impl": impl}
        )
        with TritonEngine(cfg) as eng:
            return [eng.prompt_logprobs(short, c) for c in choices]

    ref, got = run(1, "torch"), run(2, "triton")
    for c, g, r in zip(choices, got, ref):
        assert maxdiff(g, r) <= TOL, f"adapter choice {c}"


# slow: 30-55 s per arch on CI's 2 loaded cores; a profile of one forward is all Triton interpreter (its own type
# checks per op) in the MoE kernels, whose program count the tiny model's 8 experts already keep at the minimum
@pytest.mark.slow
def test_fused_paths_at_tp1_match_hf_peft(tiny, monkeypatch):
    """impl triton at TP 1 runs q|k|v LoRA as extra K of the base GEMM (kernels.lora_linear_aug, the input norm
    writing into its buffer) and hands the MoE's unsummed top-k outputs to the next norm; both must be the paths
    taken and match HF+PEFT: a mixed batch (three adapters, rows without one), one-adapter batches of slot 0 and
    of slot 2 (the other slots' shrink columns stay zero), an experts-only adapter (zero q|k|v columns), base."""
    import lpdiff.engines.triton.model as model
    import lpdiff.engines.triton.norm as norm
    from lpdiff.engines.base import open_engine
    from lpdiff.engines.triton import TritonEngine

    seen = {"aug_slots": set(), "delta_ndim": set()}
    aug, norm_ref = model.lora_linear_aug, norm.add_rms_norm_torch

    def spy_aug(*args, **kw):
        seen["aug_slots"].add(args[5] if len(args) > 5 else kw.get("uniform_slot"))
        return aug(*args, **kw)

    def spy_norm(x, delta, *args, **kw):  # in this process the norm runs its torch reference
        seen["delta_ndim"].add(None if delta is None else delta.ndim)
        return norm_ref(x, delta, *args, **kw)

    monkeypatch.setattr(model, "lora_linear_aug", spy_aug)
    monkeypatch.setattr(norm, "add_rms_norm_torch", spy_norm)
    spec, adapters, prompts = tiny
    short = [p[:10] for p in prompts]  # the interpreter's cost grows with the grid
    choices = [
        ["attn_experts", None, "shared_outer", "experts_pe", "attn_experts"],
        "attn_experts",
        "shared_outer",
        "experts_pe",
        None,
    ]

    def run(engine, names):
        options = {"impl": "triton"} if engine == "triton" else {}
        with open_engine(
            engine, EngineConfig(model=spec, adapters=adapters[names], dtype="float32", device="cpu", options=options)
        ) as eng:
            if isinstance(eng, TritonEngine):
                assert eng.runtime.model.fuse_topk_sum
            return [eng.prompt_logprobs(short, c) for c in choices]

    got, want = run("triton", "triton"), run("hf", "hf")
    for c, g, w in zip(choices, got, want):
        assert maxdiff(g, w) <= TOL, f"adapter choice {c}"
    assert seen["aug_slots"] == {None, 0, 1, 2}, seen  # mixed (mask), then each one-adapter batch's slot
    assert 3 in seen["delta_ndim"], seen


@pytest.mark.parametrize("tiny", ["qwen3_moe"], indirect=True)  # one arch: everything runs interpreted
def test_fused_norm_kernel_in_a_forward_under_the_interpreter(tiny):
    """With TRITON_INTERPRET=1 set before import (a child process) the runtime's own kernels run as Triton too, so
    a real forward has add_rms_norm's kernel sum the MoE's (T, K, H) outputs and write into the q|k|v LoRA's
    augmented buffer, and o's shrink come out of its base GEMM (lora_linear_shrink_out; a mixed and a one-adapter
    batch): against the torch references."""
    spec, adapters, prompts = tiny
    job = dict(
        path=spec.path,
        name=spec.name,
        arch=spec.arch,
        adapters={n: a.path for n, a in adapters["triton"].items()},
        prompts=[p[:6] for p in prompts[:3]],
        choices=[["attn_experts", None, "shared_outer"], "shared_outer"],
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(job)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(diffs) == 2 and max(diffs) <= TOL, diffs


def _interpreted_forward(job: dict) -> None:
    """The child of the test above: prints [max |d| per choice] of impl triton against impl torch."""
    from lpdiff.engines.triton import TritonEngine
    from lpdiff.engines.triton._jit import INTERPRETED
    from lpdiff.harness.types import AdapterSpec, ModelSpec

    assert INTERPRETED, "run through the test (it sets TRITON_INTERPRET=1)"
    spec = ModelSpec(name=job["name"], arch=job["arch"], path=job["path"])
    adapters = {n: AdapterSpec(n, p) for n, p in job["adapters"].items()}
    out = {}
    for impl in ("torch", "triton"):
        with TritonEngine(
            EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu", options={"impl": impl})
        ) as eng:
            ll = eng.runtime.model.lora.layers[0]
            assert impl == "torch" or (ll.qkv_w_aug is not None and ll.o_w_s is not None)
            out[impl] = [eng.prompt_logprobs(job["prompts"], c) for c in job["choices"]]
    print(json.dumps([maxdiff(g, r) for g, r in zip(out["triton"], out["torch"])]))


if __name__ == "__main__":
    _interpreted_forward(json.loads(sys.argv[1]))
