"""CUDA graphs of the hybrids' calls (engines/triton/runtime.py, graphs.py): the per-batch plan that keeps host reads
out of Qwen3.5's forward (gdn.chunk_indices / fla_plan, qwen3_5._one_prompt) on the host, and on CUDA (gpu1) a tiny
Qwen3.5 and a tiny Nemotron-H layout captured on its second sighting and replayed bit-identically to the eager run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.engines.triton import gdn, qwen3_5
from lpdiff.engines.triton.batch import Batch
from lpdiff.harness.commands.run import Job, resolve_job
from lpdiff.kernels import faults
from tests.helpers.fla_public import fla_public_delta_rule
from tests.helpers.graph_replay import assert_replay_equals_eager


class _Rope:
    rope_inv_freq = torch.rand(4) + 0.1
    rope_attention_scaling = 1.0


def _lens(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(n) | 1 for n in rng.integers(1, 400, size=int(rng.integers(2, 9)) | 1)]  # odd lengths, odd count


def _loop_indices(lens: list[int], chunk: int) -> list[list[int]]:
    """The definition, written as a loop: (prompt, chunk within it) for each chunk of each prompt in order."""
    return [[i, j] for i, n in enumerate(lens) for j in range(-(-n // chunk))]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_indices_match_the_definition(seed, chunk):
    lens = _lens(seed)
    got = gdn.chunk_indices(lens, chunk)
    assert got.dtype == np.int64 and got.tolist() == _loop_indices(lens, chunk)


def test_chunk_indices_equal_what_fla_computes_from_cu_seqlens():
    index = pytest.importorskip("fla.ops.utils.index")
    for seed in range(4):
        lens = _lens(100 + seed)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
        want = index.prepare_chunk_indices(cu, gdn.CHUNK)
        assert torch.equal(torch.from_numpy(gdn.chunk_indices(lens)), want)
        assert torch.equal(gdn.FlaPlan(cu, want).cu_seqlens, cu)
        plan = gdn.fla_plan(Batch.build([[1] * n for n in lens], [-1] * len(lens), _Rope(), torch.float32, cu.device))
        assert plan.chunk_offsets is not None and torch.equal(plan.chunk_offsets, index.prepare_chunk_offsets(cu, 64))


def test_fla_plan_is_made_once_per_batch_from_its_lengths():
    lens = _lens(7)
    batch = Batch.build([[1] * n for n in lens], [-1] * len(lens), _Rope(), torch.float32, torch.device("cpu"))
    plan = gdn.fla_plan(batch, make_offsets=False)
    assert gdn.fla_plan(batch, make_offsets=False) is plan  # the capture reuses the warm-up's tensors
    assert torch.equal(plan.cu_seqlens, batch.cu_seqlens.long()) and plan.cu_seqlens.dtype == torch.int64
    assert plan.chunk_indices.tolist() == _loop_indices(lens, gdn.CHUNK)


def test_one_prompt_view_is_cached_and_is_the_whole_pack_as_one_prompt():
    lens = _lens(3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]
    batch = Batch.build(prompts, [-1] * len(lens), _Rope(), torch.float32, torch.device("cpu"))
    one = qwen3_5._one_prompt(batch)
    assert qwen3_5._one_prompt(batch) is one
    old = Batch.build([batch.input_ids.tolist()], [-1], qwen3_5._RopeStub(), torch.float32, torch.device("cpu"))
    assert one.lens == old.lens == [sum(lens)]
    for f in ("cu_seqlens", "positions", "seq", "rows"):
        assert torch.equal(getattr(one, f), getattr(old, f)), f


@pytest.mark.parametrize("fault", ["state_not_reset", "conv_across_prompts"])
def test_qwen35_faults_give_the_same_logprobs_as_with_the_ids_rebuilt(fault, monkeypatch):
    """The faults' one-prompt view no longer reads the token ids back (a host read a capture refuses): the faulty
    forward is the same, bit for bit, as with the view rebuilt from the ids each time."""
    spec, adapters, _ = resolve_job(Job(model="tiny-qwen3.5-moe", adapters=("all",)))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (70, 9, 33)]
    choice = ["all", None, "all"]

    def rebuilt(batch: Batch) -> Batch:
        dev = batch.input_ids.device
        return Batch.build([batch.input_ids.tolist()], [-1], qwen3_5._RopeStub(), batch.cos.dtype, dev)

    cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu")
    with open_engine("triton", cfg) as eng, faults.injected(fault):
        got = eng.prompt_logprobs(prompts, choice)
        monkeypatch.setattr(qwen3_5, "_one_prompt", rebuilt)
        want = eng.prompt_logprobs(prompts, choice)
    with open_engine("triton", cfg) as eng:
        clean = eng.prompt_logprobs(prompts, choice)
    assert all(np.array_equal(x.logprobs, y.logprobs) for x, y in zip(got, want))
    assert not np.array_equal(got[1].logprobs, clean[1].logprobs)  # the fault did move the later prompts


# -- CUDA ----------------------------------------------------------------------------------------------------------

HYBRIDS = [
    ("tiny-qwen3.5-moe", ("all", "linear_attention"), {}, None),
    ("tiny-qwen3.5-moe", ("all", "linear_attention"), {}, "state_not_reset"),
    ("tiny-nemotron-h", ("mamba", "all"), {"mamba_scan": "auto"}, None),
    ("tiny-nemotron-h", ("mamba", "all"), {"mamba_scan": "recurrence"}, None),
]


@pytest.mark.gpu1
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("model", "names", "options", "fault"), HYBRIDS)
def test_hybrid_graph_replay_equals_eager(model, names, options, fault, dtype):
    """Graphs off, then on: the 2nd call captures (no fallback: no warning, one capture counted), the 3rd and 4th
    replay (counted), the 4th on other token ids of the same layout; every call equals the eager run bit for bit
    (logprobs, top-k, margins), adapters and base rows in one batch, odd lengths across chunk edges."""
    spec, adapters, _ = resolve_job(Job(model=model, adapters=names))
    g = torch.Generator().manual_seed(2)
    lens = (300, 17, 129, 64, 5)
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lens]
    other = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lens]
    choice = [names[0], None, names[1], names[0], None]
    assert_replay_equals_eager(spec, adapters, dtype, [prompts, prompts, prompts, other], choice, options, fault)


@pytest.mark.gpu1
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fla_with_the_plan_equals_fla_public_function(dtype):
    """gdn's call of fla with the plan's chunk indices gives the bits of fla's public chunk_gated_delta_rule (which
    computes them on the host) on fresh random packed inputs of odd lengths, v a strided view of one projection as
    the model passes it, 2 key heads repeated to 4 value heads; and the plan's call captures into a CUDA graph whose
    replay gives them again."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    dev = torch.device("cuda")
    lens = _lens(21)
    g = torch.Generator(device=dev).manual_seed(4)
    T, h, dk, dv = sum(lens), 4, 128, 64
    qkv = torch.randn(T, 2 * 2 * dk + h * dv, generator=g, device=dev).to(dtype)
    q, k, v = qkv.split([2 * dk, 2 * dk, h * dv], dim=-1)
    q, k = (t.reshape(T, 2, dk).repeat_interleave(2, dim=1) for t in (q, k))
    v = v.reshape(T, h, dv)
    decay = -torch.rand(T, h, generator=g, device=dev) * 0.3
    beta = torch.rand(T, h, generator=g, device=dev).to(dtype)
    batch = Batch.build([[0] * n for n in lens], [-1] * len(lens), _Rope(), dtype, dev)
    want = fla_public_delta_rule(q, k, v, decay, beta, batch)
    got = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "fla")
    assert torch.equal(got, want.to(dtype))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "fla")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want.to(dtype))
