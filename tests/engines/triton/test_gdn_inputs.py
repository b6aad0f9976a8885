"""Gated DeltaNet's inputs as the delta rule takes them (engines/triton/gdn.py): q and k at their key heads (value
head i reads key head i // (h // hk), what repeat_interleave writes out), and the conv split into q / k / v channel
groups. On the CPU the torch paths (the reference); on CUDA (gpu1, fla-core 0.5.2) fla's conv and GVA delta rule
against them, under a CUDA graph too, and the tiny Qwen3.5 in bf16 against the repeated-heads / torch-conv inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.triton import gdn, qwen3_5
from lpdiff.engines.triton.batch import Batch
from tests.helpers.fla_public import fla_public_delta_rule


class _Rope:
    rope_inv_freq = torch.rand(4) + 0.1
    rope_attention_scaling = 1.0


def _batch(lens, dtype=torch.float32, dev="cpu") -> Batch:
    return Batch.build([[0] * n for n in lens], [-1] * len(lens), _Rope(), dtype, torch.device(dev))


def _inputs(T: int, hk: int, h: int, dk: int, dv: int, seed: int, dev="cpu"):
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k = (torch.randn(T, hk, dk, generator=g, device=dev) for _ in range(2))
    v = torch.randn(T, h, dv, generator=g, device=dev)
    decay = -torch.rand(T, h, generator=g, device=dev) * 0.5
    beta = torch.rand(T, h, generator=g, device=dev)
    return q, k, v, decay, beta


@pytest.mark.parametrize("lens", [[7, 64, 129], [5, 200, 3]])  # the padded view; prompt by prompt
def test_torch_delta_rule_takes_key_heads(lens):
    """q/k at 2 key heads with 6 value heads give the bits of q/k repeated to 6 heads, and each prompt equals the
    token-by-token recurrence with value head i reading key head i // 3 (not i % 2: a tiled repeat fails this)."""
    T, hk, h = sum(lens), 2, 6
    q, k, v, decay, beta = _inputs(T, hk, h, 12, 20, len(lens))
    batch = _batch(lens)
    got = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "torch")
    qr, kr = q.repeat_interleave(3, dim=1), k.repeat_interleave(3, dim=1)
    assert torch.equal(got, gdn.gated_delta_rule(qr, kr, v, decay, beta, batch, "torch"))
    start = 0
    for n in lens:
        s = slice(start, start + n)
        ref = gdn.gated_delta_rule_recurrent(*(t[s][None] for t in (qr, kr, v, decay, beta)))[0]
        assert torch.allclose(got[s], ref, atol=2e-5, rtol=1e-5), (n, (got[s] - ref).abs().max())
        start += n
    tiled = gdn.gated_delta_rule(q.repeat(1, 3, 1), k.repeat(1, 3, 1), v, decay, beta, batch, "torch")
    assert (tiled - got).abs().max() > 1e-2


def test_delta_rule_refuses_heads_that_do_not_divide():
    q, k, v, decay, beta = _inputs(9, 4, 6, 8, 8, 0)
    with pytest.raises(ValueError, match="dividing v's 6"):
        gdn.gated_delta_rule(q, k, v, decay, beta, _batch([4, 5]), "torch")
    with pytest.raises(ValueError, match="same heads"):
        gdn.gated_delta_rule(q[:, :2], k[:, :3], v, decay, beta, _batch([4, 5]), "torch")


def test_torch_conv_parts_are_the_conv_split():
    """The torch path of causal_conv1d_parts on a strided column block (as the model passes the in projection's
    q|k|v part): causal_conv1d's output split at the widths, bit for bit; no window crosses a prompt boundary."""
    g = torch.Generator().manual_seed(11)
    lens, widths = [5, 70, 1, 33], [6, 6, 10]
    proj = torch.randn(sum(lens), sum(widths) + 7, generator=g)
    x, w = proj[:, 3 : 3 + sum(widths)], torch.randn(sum(widths), 4, generator=g)
    batch = _batch(lens)
    parts = gdn.causal_conv1d_parts(x, w, batch, widths, "torch")
    assert [p.shape[1] for p in parts] == widths
    assert torch.equal(torch.cat(parts, dim=1), gdn.causal_conv1d(x, w, batch))
    alone = gdn.causal_conv1d(x[5:75], w, _batch([70]))  # the second prompt by itself
    assert torch.equal(torch.cat(parts, dim=1)[5:75], alone)


def test_linear_attention_trace_keeps_transformers_repeated_heads(tiny_qwen35_model, monkeypatch):
    """The bisect trace's conv1d step is q | k | v with q and k repeated to the value heads (as engines/hf_steps.py
    records transformers'), while the forward itself hands the delta rule the key heads."""
    m, batch, h = tiny_qwen35_model
    seen = {}
    real = gdn.gated_delta_rule

    def spy(q, k, v, *a):
        seen["heads"] = (q.shape[1], k.shape[1], v.shape[1])
        return real(q, k, v, *a)

    lw = next(lw for lw in m.w.layers if lw.kind == "linear_attention")
    trace: dict = {}
    monkeypatch.setattr(gdn, "gated_delta_rule", spy)
    out = m.linear_attention(h, lw, None, batch, trace)
    monkeypatch.undo()
    assert seen["heads"] == (m.lin_k, m.lin_k, m.lin_v) and m.lin_k < m.lin_v
    q, k, v = trace["conv1d"]
    assert q.shape[1] == k.shape[1] == v.shape[1] == m.lin_v
    assert torch.equal(out, m.linear_attention(h, lw, None, batch))


@pytest.fixture(scope="module")
def tiny_qwen35_model():
    """The tiny Qwen3.5's runtime model (fp32, CPU) with a packed batch and a random hidden input."""
    from lpdiff.engines.base import EngineConfig, open_engine
    from lpdiff.harness.commands.run import Job, resolve_job

    spec, adapters, _ = resolve_job(Job(model="tiny-qwen3.5-moe", adapters=("all",)))
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu")) as eng:
        m = eng.runtime.model
        batch = Batch.build([[1] * n for n in (9, 70, 3)], [-1] * 3, m.cfg, torch.float32, torch.device("cpu"))
        h = torch.randn(batch.num_tokens, m.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
        yield m, batch, h


# -- CUDA (fla-core 0.5.2) -----------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


EPS = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # machine epsilon of each 16-bit dtype


@pytest.mark.gpu1
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("across", [False, True])
def test_fla_conv_parts_match_the_torch_conv(dtype, across):
    """fla 0.5.2's conv per channel group (varlen over the plan, SiLU after it) against the torch conv of the same
    strided column block, odd lengths across 64-token chunk edges, odd widths: each group contiguous, at most 0.1 %
    of the elements not bit-equal (the conv's fp32 sum of exact 16-bit products in another order can round to the
    neighbouring value) and none off by more than 2 eps of the group's largest value.
    ``across``: the conv_across_prompts fault's one-prompt view, whose later prompts do read the earlier ones."""
    pytest.importorskip("fla.modules.conv.triton.ops")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    lens, widths = [300, 17, 129, 64, 5, 1], [96, 96, 200]
    proj = torch.randn(sum(lens), sum(widths) + 40, generator=g, device=dev).to(dtype)
    x = proj[:, 8 : 8 + sum(widths)]
    w = (torch.randn(sum(widths), 4, generator=g, device=dev) * 0.5).to(dtype)
    batch = _batch(lens, dtype, "cuda")
    view = qwen3_5._one_prompt(batch) if across else batch
    got = gdn.causal_conv1d_parts(x, w, view, widths, "fla")
    want = gdn.causal_conv1d(x, w, view).split(widths, dim=-1)
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.shape == b.shape and a.dtype == dtype
        diff = (a.float() - b.float()).abs()
        assert diff.max().item() <= 2 * EPS[dtype] * b.float().abs().max().item(), diff.max().item()
        assert (diff > 0).float().mean().item() <= 1e-3
    clean = torch.cat(gdn.causal_conv1d_parts(x, w, batch, widths, "fla"), dim=1)
    moved = (torch.cat(got, dim=1) - clean).abs().amax(dim=1) > 0
    assert bool(moved[300:303].any()) == across  # the second prompt's first tokens see the first prompt's last


@pytest.mark.gpu1
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fla_delta_rule_with_key_heads(dtype):
    """fla with q/k at 2 key heads and 4 value heads (as the model passes them now) against: fla's public
    chunk_gated_delta_rule on the same GVA inputs (bit for bit: same kernels), and fla on q/k repeated to 4 heads
    (the previous inputs; bit for bit unless the autotuner, keyed on H, picked other tiles: then no farther from the
    fp32 torch form than they are); and under a CUDA graph the plan's call replays the same bits."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    lens = [300, 17, 1024, 64, 5]
    T, hk, h, dk, dv = sum(lens), 2, 4, 128, 128
    q, k, v, decay, beta = _inputs(T, hk, h, dk, dv, 9, "cuda")
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    batch = _batch(lens, dtype, "cuda")
    got = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "fla")
    want = fla_public_delta_rule(q, k, v, decay, beta, batch)
    assert torch.equal(got, want.to(dtype))
    qr, kr = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)
    old = gdn.gated_delta_rule(qr, kr, v, decay, beta, batch, "fla")
    ref = gdn.gated_delta_rule(q.float(), k.float(), v.float(), decay, beta.float(), batch, "torch")
    err_new, err_old = ((t.float() - ref).abs().max().item() for t in (got, old))
    print(f"GVA vs repeated heads: bit-equal {torch.equal(got, old)}, max err vs fp32 {err_new:.3g} / {err_old:.3g}")
    assert torch.equal(got, old) or err_new <= 1.25 * err_old
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "fla")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.gpu1
@needs_gpu
@pytest.mark.parametrize("fault", [None, "conv_across_prompts"])
def test_qwen35_graph_replay_with_the_fla_conv(fault):
    """The tiny Qwen3.5 in bf16 on CUDA (fla conv and GVA delta rule under "auto"): captured on the second call and
    replayed bit-identically to the eager run, the conv_across_prompts fault's one-prompt plan included."""
    pytest.importorskip("fla.modules.conv.triton.ops")
    from lpdiff.harness.commands.run import Job, resolve_job
    from tests.helpers.graph_replay import assert_replay_equals_eager

    spec, adapters, _ = resolve_job(Job(model="tiny-qwen3.5-moe", adapters=("all", "linear_attention")))
    g = torch.Generator().manual_seed(6)
    lens = (300, 17, 129, 64, 5)
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lens]
    other = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lens]
    choice = ["all", None, "linear_attention", "all", None]
    assert_replay_equals_eager(spec, adapters, "bfloat16", [prompts, prompts, prompts, other], choice, None, fault)


@pytest.mark.gpu1
@needs_gpu
def test_qwen35_bf16_inputs_no_farther_from_fp32_than_the_previous_inputs(monkeypatch):
    """The tiny Qwen3.5's bf16 logprobs on CUDA with the fla conv and key-head q/k, and with the previous inputs (the
    torch conv split, q/k repeated to the value heads before fla): the new ones equal the previous ones bit for bit,
    or are no farther from the fp32 run than they are (max |logprob difference|)."""
    pytest.importorskip("fla.modules.conv.triton.ops")
    from lpdiff.engines.base import EngineConfig, open_engine
    from lpdiff.harness.commands.run import Job, resolve_job

    spec, adapters, _ = resolve_job(Job(model="tiny-qwen3.5-moe", adapters=("all",)))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in (300, 17, 129, 64, 5)]
    choice = ["all", None, "all", "all", None]

    def run(dtype):
        cfg = EngineConfig(model=spec, adapters=adapters, dtype=dtype, device="cuda", options={"cuda_graphs": 0})
        with open_engine("triton", cfg) as eng:
            return [r.logprobs for r in eng.prompt_logprobs(prompts, choice)]

    ref, new = run("float32"), run("bfloat16")
    rule = gdn.gated_delta_rule

    def repeated(q, k, v, *a):
        r = v.shape[1] // k.shape[1]
        return rule(q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1), v, *a)

    monkeypatch.setattr(gdn, "gated_delta_rule", repeated)
    monkeypatch.setattr(qwen3_5, "FUSED_GDN_INPUT", False)  # the previous inputs come from the unfused chain
    monkeypatch.setattr(
        gdn, "causal_conv1d_parts", lambda x, w, b, widths, impl: gdn.causal_conv1d(x, w, b).split(widths, -1)
    )
    old = run("bfloat16")
    err = [max(float(np.abs(a - r).max()) for a, r in zip(run_, ref)) for run_ in (new, old)]
    same = all(np.array_equal(a, b) for a, b in zip(new, old))
    print(f"bf16 new vs previous inputs: bit-equal {same}, max |dlogprob| vs fp32 {err[0]:.3g} / {err[1]:.3g}")
    assert same or err[0] <= 1.25 * err[1]
