"""Qwen3.5's fused passes against the torch chains they replace: the attention's q/k RMSNorm + partial rope
(rope.norm_partial_rope_qk), its output gate (qwen3_5_kernels.sigmoid_gate), the GDN's decay and write strength
(qwen3_5_kernels.gdn_gates), its conv + SiLU + q/k L2 norm (gdn_conv.conv_silu_l2norm), the shared expert's
SiLU-and-mul (qwen3_5_kernels.silu_mul) and the MoE block's tail fused into the residual add + RMSNorm
(norm.add_rms_norm with shared and shared_gate: top-k sum + sigmoid(gate) * shared + residual).

CPU: the kernels interpreted in a child Python started with TRITON_INTERPRET=1 (engines/triton/_jit.py fixes the
mode at import), fresh random inputs, odd token counts and widths, inputs as the model passes them (strided views of
the projections). fp32 and fp16 (whose casts the interpreter rounds to nearest, as compiled Triton does) are held to
the chains' roundings: at most one ulp on a small fraction of elements, from the kernels' fp32 sum order or exp. bf16
only loosely: the interpreter truncates fp32 -> bf16 casts.
GPU (gpu1): compiled at Qwen3.5-35B-A3B's sizes (T = 8 x 512 + 33), fp32 and bf16 against the chains, each kernel
captured in a CUDA graph and replayed to the eager bits, times printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lpdiff.engines.triton._jit import tl, triton
from tests.helpers.cuda_kernel import captured_equals_eager, launch_us
from tests.helpers.paths import REPO


def _ulps(got, ref, floor: float = 2.0**-60):
    """(largest difference in ulps of the reference's dtype, at magnitudes of at least ``floor``; fraction of
    elements that differ)"""
    mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[ref.dtype]
    d = (got.float() - ref.float()).abs()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(floor))) - mant)
    return float((d / ulp).max()), float((d > 0).float().mean())


def _check(got, ref, what):
    """fp32: within 1e-5 of the largest element (an ulp of a norm's fp32 sum scales a whole head; a rope sum may
    cancel it into many ulps of a small output). fp16: equal but for one-ulp flips on a few elements. bf16: close
    (the interpreter truncates fp32 -> bf16 casts; the GPU test holds bf16 to the fp16 rule)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=what)
    elif ref.dtype == torch.bfloat16:
        err = ((got.float() - ref.float()).abs() / ref.float().abs().clamp(min=1)).max().item()
        assert err <= 5e-2, f"{what}: max relative error {err:.3g}"  # up to 6 truncated casts in a chain
    else:
        worst, f = _ulps(got, ref)
        print(f"{what}: {f:.2e} of elements differ, at most {worst:.1f} ulp")
        assert worst <= 1 and f <= 2e-2, f"{what}: {f:.2e} of elements differ, at most {worst:.1f} ulp"


def attention_inputs(T, heads, kv_heads, d, rotary, dtype, g, device="cpu"):
    """The q|gate heads, k and v of one q|k|v projection row block (strided views, as full_attention splits them),
    fp32 norm weights 1 + w, cos/sin (T, rotary / 2) in the dtype."""
    qkv = torch.randn(T, heads * 2 * d + 2 * kv_heads * d, generator=g).to(dtype).to(device)
    qg, k, _ = qkv.split([heads * 2 * d, kv_heads * d, kv_heads * d], dim=-1)
    q, gate = qg.view(T, heads, 2 * d).chunk(2, dim=-1)
    wq, wk = (1 + 0.2 * torch.randn(d, generator=g)).to(device), (1 + 0.2 * torch.randn(d, generator=g)).to(device)
    ang = torch.rand(T, rotary // 2, generator=g) * 6.3
    return q, gate, k.view(T, kv_heads, d), wq, wk, ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def gdn_inputs(T, nv, dtype, g, device="cpu"):
    """a and b as column blocks of the GDN in projection, some a beyond softplus' threshold and far below zero."""
    proj = (3 * torch.randn(T, 40 + 2 * nv, generator=g)).to(dtype)
    proj[:2, 40 + nv :] = torch.tensor([25.0, -40.0]).to(dtype)[:, None]  # softplus' x > 20 and exp underflow rows
    proj = proj.to(device)
    b, a = proj[:, 40 : 40 + nv], proj[:, 40 + nv :]
    a_log = torch.randn(nv, generator=g).to(dtype).to(device)
    dt_bias = torch.randn(nv, generator=g).to(dtype).to(device)
    return a, b, a_log, dt_bias


def moe_inputs(T, K, H, dtype, g, device="cpu"):
    """Residual x, the MoE's weighted top-k outputs (magnitudes over a few decades: inexact fp32 sums), the shared
    expert's output and its gate logit (T, 1), an fp32 norm weight."""
    x = torch.randn(T, H, generator=g).to(dtype)
    delta = (torch.randn(T, K, H, generator=g) * torch.exp(2 * torch.randn(T, K, 1, generator=g))).to(dtype)
    shared = torch.randn(T, H, generator=g).to(dtype)
    gate = (2 * torch.randn(T, 1, generator=g)).to(dtype)
    w = 1 + 0.1 * torch.randn(H, generator=g)
    return [t.to(device) for t in (x, delta, shared, gate, w)]


def check_partial_rope(dtype):
    from lpdiff.engines.triton.rope import norm_partial_rope_qk, norm_partial_rope_torch

    g = torch.Generator().manual_seed(11)
    # (heads, kv_heads, d, rotary): 3 heads (masked head rows), half 3 and a 14-wide pass-through (neither a power
    # of two), a fully rotary head, Qwen3.5's 1/4 factor
    for heads, kv, d, rot in ((3, 1, 20, 6), (2, 2, 16, 16), (4, 1, 32, 8)):
        q, _, k, wq, wk, cos, sin = attention_inputs(7, heads, kv, d, rot, dtype, g)
        got_q, got_k = norm_partial_rope_qk(q, k, wq, wk, 1e-6, cos, sin, rot, impl="triton")
        assert got_q.is_contiguous() and got_k.is_contiguous()
        what = f"partial rope {dtype} heads={heads} d={d} rotary={rot}"
        _check(got_q, norm_partial_rope_torch(q, wq, 1e-6, cos, sin, rot), what + " q")
        _check(got_k, norm_partial_rope_torch(k, wk, 1e-6, cos, sin, rot), what + " k")


def check_sigmoid_gate(dtype):
    from lpdiff.engines.triton.qwen3_5_kernels import sigmoid_gate, sigmoid_gate_torch

    g = torch.Generator().manual_seed(12)
    _, gate, *_ = attention_inputs(5, 3, 1, 20, 4, dtype, g)
    o = torch.randn(5, 3, 20, generator=g).to(dtype)
    for oo in (o, torch.randn(5, 3, 40, generator=g).to(dtype)[..., 10:30]):  # contiguous and strided o
        got = sigmoid_gate(oo, gate, impl="triton")
        _check(got, sigmoid_gate_torch(oo, gate), f"sigmoid gate {dtype} contiguous={oo.is_contiguous()}")


def check_silu_mul(dtype):
    from lpdiff.engines.triton.qwen3_5_kernels import silu_mul, silu_mul_torch

    g = torch.Generator().manual_seed(15)
    gate_up = (3 * torch.randn(9, 2 * 37, generator=g)).to(dtype)  # S = 37: a masked tail
    _check(silu_mul(gate_up, impl="triton"), silu_mul_torch(gate_up), f"silu_mul {dtype}")


def check_gdn_gates(dtype):
    from lpdiff.engines.triton.qwen3_5_kernels import gdn_gates, gdn_gates_torch

    g = torch.Generator().manual_seed(13)
    a, b, a_log, dt_bias = gdn_inputs(37, 6, dtype, g)
    got_g, got_beta = gdn_gates(a, b, a_log, dt_bias, impl="triton")
    ref_g, ref_beta = gdn_gates_torch(a, b, a_log, dt_bias)
    assert got_g.dtype == torch.float32 and got_beta.dtype == dtype
    # g in fp32 from fp32 exp / log: a few fp32 ulps (torch's log1p against the Goldberg form), no more
    torch.testing.assert_close(got_g, ref_g, rtol=2e-6, atol=0)
    _check(got_beta, ref_beta, f"gdn beta {dtype}")


class _NoRope:
    """Batch.build's cfg where only the layout (positions) is read."""

    rope_inv_freq = torch.zeros(1)
    rope_attention_scaling = 1.0


def conv_inputs(lens, nk, dk, nv, dv, dtype, g, device="cpu"):
    """The q|k|v column block of a GDN in projection (strided), a (C, 4) conv weight, the packed batch of ``lens``."""
    from lpdiff.engines.triton.batch import Batch

    C, T = 2 * nk * dk + nv * dv, sum(lens)
    proj = torch.randn(T, C + 2 * nv + 5, generator=g).to(dtype).to(device)
    weight = (0.5 * torch.randn(C, 4, generator=g)).to(dtype).to(device)
    batch = Batch.build([[0] * n for n in lens], [-1] * len(lens), _NoRope(), dtype, torch.device(device))
    return proj[:, :C], weight, batch


def check_gdn_conv(dtype):
    from lpdiff.engines.triton import gdn
    from lpdiff.engines.triton.gdn_conv import conv_silu_l2norm, conv_silu_l2norm_torch, l2norm_torch

    g = torch.Generator().manual_seed(16)
    # prompts of 1 and 2 tokens (shorter than the window), boundaries inside a 32-token block; dk != dv (masked
    # columns of the 32-wide head block), two value heads per key head
    for nk, dk, nv, dv in ((2, 16, 4, 16), (1, 24, 2, 20)):
        x, w, batch = conv_inputs([5, 1, 40, 2, 3], nk, dk, nv, dv, dtype, g)
        got = conv_silu_l2norm(x, w, batch.positions, nk, dk, nv, dv)
        ref = conv_silu_l2norm_torch(x, w, batch.positions, nk, dk, nv, dv)
        what = f"gdn conv {dtype} nk={nk} dk={dk} nv={nv} dv={dv}"
        for name, a, b in zip("qkv", got, ref):
            assert a.is_contiguous(), what
            _check(a, b, f"{what} {name}")
        # the reference is the chain it replaces: torch's conv + SiLU per prompt, then fla's L2 norm of q and k
        T = x.shape[0]
        cq, ck, cv = gdn.causal_conv1d(x, w, batch).split([nk * dk, nk * dk, nv * dv], dim=-1)
        chain = (l2norm_torch(cq.reshape(T, nk, dk)), l2norm_torch(ck.reshape(T, nk, dk)), cv.reshape(T, nv, dv))
        for name, a, b in zip("qkv", ref, chain):
            if dtype == torch.float32:  # torch's conv sums its taps in another order
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{what} {name} reference vs chain")
            else:
                assert torch.equal(a, b), f"{what} {name} reference vs chain"


def check_moe_tail(dtype):
    from lpdiff.engines.triton.norm import add_rms_norm, add_rms_norm_torch, moe_delta

    g = torch.Generator().manual_seed(14)
    for K in (1, 8):
        x, delta, shared, gate, w = moe_inputs(6, K, 75, dtype, g)  # 75: masked tail of the row block
        for sh, gt in ((shared, gate), (shared, None)):  # Qwen3.5's gated shared expert; an ungated one
            what = f"moe tail {dtype} K={K} gate={gt is not None}"
            ref = add_rms_norm_torch(x, delta, w, 1e-6, True, sh, gt)
            # the reference is the unfused chain: torch's sum, the block's add, then the (T, H) norm
            unfused = delta.sum(1) + (sh if gt is None else torch.sigmoid(gt) * sh)
            assert torch.equal(moe_delta(delta, sh, gt), unfused) or dtype == torch.float32, what
            got = add_rms_norm(x, delta, w, 1e-6, True, "triton", None, sh, gt)
            _check(got[1], ref[1], what + " residual")
            _check(got[0], ref[0], what + " normed")


if triton is not None:
    from lpdiff.engines.triton.norm import rounded

    @triton.jit
    def _round_bf16_kernel(X, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + i, rounded(tl.load(X + i, mask=i < n), tl.bfloat16), mask=i < n)


def check_rope_rounding():
    """norm.rounded's bf16 rounding on the bits equals torch's cast (nearest even) on every kind of fp32: ties,
    subnormals, values that round up a binade or to inf; the interpreter runs its integer ops exactly."""
    from lpdiff.engines.triton._jit import triton

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20011, generator=g) * torch.exp(8 * torch.randn(20011, generator=g))
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895e38, 3.39e38, 1e-40, -1e-39, 0.0])
    x = torch.cat([x, ties])
    y = torch.empty_like(x)
    _round_bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y, x.to(torch.bfloat16).float()), (x[y != x.to(torch.bfloat16).float()][:5], y[:5])


def run_all():
    check_rope_rounding()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        check_partial_rope(dtype)
        check_sigmoid_gate(dtype)
        check_silu_mul(dtype)
        check_gdn_gates(dtype)
        check_gdn_conv(dtype)
        check_moe_tail(dtype)
    print("all qwen3.5 fused-kernel checks passed")


def test_qwen35_fused_kernels_match_the_torch_chains_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all qwen3.5 fused-kernel checks passed" in proc.stdout


def test_bad_shapes_are_refused_before_a_launch():
    """The entry points name what they need rather than launching on a layout the kernels do not index."""
    from lpdiff.engines.triton.norm import add_rms_norm

    x, delta, shared, gate, w = moe_inputs(4, 2, 8, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="shared must come with a delta"):
        add_rms_norm(x, None, w, 1e-6, True, "torch", None, shared, None)
    with pytest.raises(ValueError, match="shared_gate must come with shared"):
        add_rms_norm(x, delta, w, 1e-6, True, "torch", None, None, gate)


def test_qwen35_forward_under_the_interpreter():
    """The tiny zoo Qwen3.5 (3 Gated DeltaNet layers + 1 gated attention layer) with every runtime kernel run as
    Triton (a child Python with TRITON_INTERPRET=1): the MoE blocks hand their parts to the next norm (the routed
    (T, K, H) unsummed, the shared output and gate), the attention layer takes the partial-rope and gate kernels,
    the GDN layers the g / beta kernel;
    fp32 logprobs against impl torch (the chains), a base row beside two adapters in one batch."""
    from lpdiff.harness.commands.run import Job, resolve_job

    spec, adapters, _ = resolve_job(Job(model="tiny-qwen3.5-moe", adapters=("all", "attention")))
    g = torch.Generator().manual_seed(3)
    job = dict(
        path=spec.path,
        name=spec.name,
        arch=spec.arch,
        adapters={n: a.path for n, a in adapters.items()},
        prompts=[torch.randint(0, 1024, (n,), generator=g).tolist() for n in (9, 3, 14)],
        choices=[["all", None, "attention"]],
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(job)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fused_tails"] > 0 and out["topk_unsummed"] > 0 and out["kernels"] == ["gdn_gates", "partial_rope"]
    assert len(out["diffs"]) == 1 and max(out["diffs"]) <= 1e-4, out


def _interpreted_forward(job: dict) -> None:
    """The child of the test above: prints {diffs: [max |d| per choice] of impl triton against impl torch, how
    often the fused paths ran}."""
    import numpy as np

    from lpdiff.engines.base import EngineConfig
    from lpdiff.engines.triton import TritonEngine, qwen3_5
    from lpdiff.engines.triton._jit import INTERPRETED
    from lpdiff.harness.types import AdapterSpec, ModelSpec

    assert INTERPRETED, "run through the test (it sets TRITON_INTERPRET=1)"
    seen = {"fused_tails": 0, "topk_unsummed": 0, "kernels": set()}
    add_rms_norm, rope, gates = qwen3_5.add_rms_norm, qwen3_5.norm_partial_rope_qk, qwen3_5.gdn_gates

    def spy_norm(x, delta, *a):
        if len(a) > 5 and a[5] is not None:
            seen["fused_tails"] += a[3] != "torch"
            seen["topk_unsummed"] += delta.ndim == 3
        return add_rms_norm(x, delta, *a)

    def spy(name, fn):
        def run(*a):
            seen["kernels"].add(name) if a[-1] != "torch" else None
            return fn(*a)

        return run

    qwen3_5.add_rms_norm, qwen3_5.norm_partial_rope_qk = spy_norm, spy("partial_rope", rope)
    qwen3_5.gdn_gates = spy("gdn_gates", gates)
    spec = ModelSpec(name=job["name"], arch=job["arch"], path=job["path"])
    adapters = {n: AdapterSpec(n, p) for n, p in job["adapters"].items()}
    out = {}
    for impl in ("torch", "triton"):
        cfg = EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu", options={"impl": impl})
        with TritonEngine(cfg) as eng:
            out[impl] = [eng.prompt_logprobs(job["prompts"], c) for c in job["choices"]]
    diffs = [
        max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(x, y))
        for x, y in zip(out["triton"], out["torch"])
    ]
    print(json.dumps({**seen, "kernels": sorted(seen["kernels"]), "diffs": diffs}))


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen35_fused_kernels_on_cuda(dtype):
    """Qwen3.5-35B-A3B's widths (16 query heads and 2 kv heads of 256, rotary 64; 32 GDN value heads; hidden 2048,
    top-8), 4096 + 33 tokens: fp32 within a few ulps of the chains; bf16 equal but for rare one-ulp flips (the
    kernels' fp32 sum order or exp against torch's); every kernel replays from a CUDA graph to its eager bits."""
    from lpdiff.engines.triton.gdn_conv import conv_silu_l2norm, conv_silu_l2norm_torch
    from lpdiff.engines.triton.norm import add_rms_norm, add_rms_norm_torch
    from lpdiff.engines.triton.qwen3_5_kernels import (
        gdn_gates,
        gdn_gates_torch,
        sigmoid_gate,
        sigmoid_gate_torch,
        silu_mul,
        silu_mul_torch,
    )
    from lpdiff.engines.triton.rope import norm_partial_rope_qk, norm_partial_rope_torch

    T, g, dev = 4129, torch.Generator().manual_seed(5), "cuda"  # 8 x 512 + 33
    q, gate, k, wq, wk, cos, sin = attention_inputs(T, 16, 2, 256, 64, dtype, g, dev)
    o = torch.randn(T, 16, 256, generator=g).to(dtype).to(dev)
    a, b, a_log, dt_bias = gdn_inputs(T, 32, dtype, g, dev)
    x, delta, shared, sgate, w = moe_inputs(T, 8, 2048, dtype, g, dev)
    gate_up = (3 * torch.randn(T, 2 * 512, generator=g)).to(dtype).to(dev)  # the shared expert's 512 wide
    cx, cw, cb = conv_inputs([512] * 8 + [33], 16, 128, 32, 128, dtype, g, dev)
    cases = {
        "norm_partial_rope_qk": (
            lambda: norm_partial_rope_qk(q, k, wq, wk, 1e-6, cos, sin, 64),
            lambda: (
                norm_partial_rope_torch(q, wq, 1e-6, cos, sin, 64),
                norm_partial_rope_torch(k, wk, 1e-6, cos, sin, 64),
            ),
        ),
        "sigmoid_gate": (lambda: (sigmoid_gate(o, gate),), lambda: (sigmoid_gate_torch(o, gate),)),
        "silu_mul": (lambda: (silu_mul(gate_up),), lambda: (silu_mul_torch(gate_up),)),
        "gdn_gates": (lambda: gdn_gates(a, b, a_log, dt_bias), lambda: gdn_gates_torch(a, b, a_log, dt_bias)),
        "gdn_conv": (
            lambda: conv_silu_l2norm(cx, cw, cb.positions, 16, 128, 32, 128),
            lambda: conv_silu_l2norm_torch(cx, cw, cb.positions, 16, 128, 32, 128),
        ),
        "moe_tail": (
            lambda: add_rms_norm(x, delta, w, 1e-6, True, "triton", None, shared, sgate),
            lambda: add_rms_norm_torch(x, delta, w, 1e-6, True, shared, sgate),
        ),
    }
    failed = []  # every kernel checked and timed before the test fails: one GPU run shows them all
    for name, (fused, chain) in cases.items():
        got, ref = fused(), chain()
        for i, (gt, rf) in enumerate(zip(got, ref)):
            # rope's differences cancel: a flipped normed value is one ulp of the O(1) products, not of their
            # difference, so its ulps are counted at magnitude 1 (the normed heads' scale)
            worst, frac = _ulps(gt, rf, 1.0 if name == "norm_partial_rope_qk" else 2.0**-60)
            print(f"{name}[{i}] {dtype}: {frac:.2e} of elements differ, at most {worst:.1f} ulp")
            if rf.dtype == torch.float32:  # incl. g of a bf16 run: exp / log in fp32
                if not torch.allclose(gt, rf, rtol=1e-5, atol=1e-5 * float(rf.abs().max())):
                    failed.append((name, i, "fp32 beyond rtol 1e-5"))
            elif not (worst <= 2 and frac <= 1e-3):
                # one ulp born in an fp32 sum (norms, top-k sum) or exp, rounded again by a later op: 2 allowed
                failed.append((name, i, worst, frac))
        captured_equals_eager(fused, got)
        print(f"{name} {dtype} T={T}: fused {launch_us(fused):.1f} us, torch chain {launch_us(chain):.1f} us")
    assert not failed, failed


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
def test_gdn_conv_against_fla_on_cuda():
    """The fused GDN input pass against the kernels it replaces on the fla path (fla 0.5.2's causal_conv1d_fwd per
    channel group, torch's SiLU, fla's l2norm_fwd on q and k) at Qwen3.5-35B-A3B's widths, bf16, ragged prompts:
    equal but for rare one-ulp flips (the conv's tap order, the norm's sum order); times printed."""
    from lpdiff.engines.triton import gdn
    from lpdiff.engines.triton.gdn_conv import conv_silu_l2norm

    if not gdn.fla_available():
        pytest.skip("needs fla-core 0.5.2 (pip extra fla)")
    from fla.modules.l2norm import l2norm_fwd

    nk, dk, nv, dv = 16, 128, 32, 128
    x, w, batch = conv_inputs(
        [512, 300, 1, 2, 777, 64, 2400, 33], nk, dk, nv, dv, torch.bfloat16, torch.Generator().manual_seed(6), "cuda"
    )
    T = x.shape[0]

    def chain():
        q, k, v = gdn.causal_conv1d_parts(x, w, batch, [nk * dk, nk * dk, nv * dv], "fla")
        qn, _ = l2norm_fwd(q.reshape(1, T, nk, dk))
        kn, _ = l2norm_fwd(k.reshape(1, T, nk, dk))
        return qn[0], kn[0], v.reshape(T, nv, dv)

    def fused():
        return conv_silu_l2norm(x, w, batch.positions, nk, dk, nv, dv)

    got, ref = fused(), chain()
    for name, a, b in zip("qkv", got, ref):
        worst, frac = _ulps(a, b)
        print(f"gdn conv vs fla {name}: {frac:.2e} of elements differ, at most {worst:.1f} ulp")
        assert worst <= 2 and frac <= 1e-3, (name, worst, frac)
    captured_equals_eager(fused, got)
    print(f"gdn conv T={T}: fused {launch_us(fused):.1f} us, fla conv + SiLU + l2norm {launch_us(chain):.1f} us")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the test (it sets TRITON_INTERPRET=1)"
    if len(sys.argv) > 1:
        _interpreted_forward(json.loads(sys.argv[1]))
    else:
        run_all()
