"""kernels/gated_norm.py: the fused gated RMSNorm (mamba_ssm's layernorm_gated forward, vendored, with transformers'
two 16-bit roundings added) against the torch chains, and the chains against transformers' own modules.

CPU: the kernel interpreted, both semantics (Qwen3.5's norm-then-gate per head, Nemotron-H's gate-then-norm per
group), fp32 and bf16, odd token counts (17, 129), head_dim 128 and an odd group size (37, three groups), the gate a
strided column slice as the engines pass it. Triton 3.6's interpreter converts fp32 to bf16 by truncation (as
tests/kernels/test_moe_grouped.py found), so bf16 is checked against the chain with its casts truncated the same way;
the GPU test checks it against the chain itself.
GPU (gpu1): compiled, at Qwen3.5-35B-A3B's and Nemotron-3 Nano's / Super's widths, against the chains, captured in a
CUDA graph, and timed (printed)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lpdiff.kernels import gated_norm
from lpdiff.kernels.gated_norm import gate_then_norm_torch, gated_rms_norm_triton, norm_then_gate_torch
from tests.helpers.cuda_kernel import captured_equals_eager, launch_us


def _inputs(T, width, dtype, seed, device="cpu"):
    """x (T, width) and a gate that is the middle third of a wider projection (a strided view, as both engines
    split it from their in_proj), fresh normal values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, width, generator=g).to(dtype).to(device)
    z = torch.randn(T, 3 * width, generator=g).to(dtype).to(device)[:, width : 2 * width]
    assert not z.is_contiguous()
    return x, z, g


def _trunc(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the bf16 value the interpreter's conversion gives (truncation), kept in fp32."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).view(t.shape)


def _norm_then_gate_truncated(x, z, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _trunc(_trunc(_trunc(xf) * w.float()) * F.silu(z.float()))


def _gate_then_norm_truncated(x, z, w, group_size, eps):
    h = x.float() * F.silu(z.float())
    hg = h.view(*h.shape[:-1], -1, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    n = hg.view(h.shape)
    return _trunc((_trunc(n) if x.dtype != torch.float32 else n) * w.float())


def _qwen(T, heads, d, dtype, seed):
    x, z, g = _inputs(T, heads * d, dtype, seed)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    got = gated_rms_norm_triton(x, z, w.repeat(heads), d, 1e-6, True, dtype).view(T, heads, d)
    return got, x.view(T, heads, d), z.view(T, heads, d), w


@pytest.mark.parametrize("T", [17, 129])
def test_norm_then_gate_fp32_matches_the_chain(T):
    got, x, z, w = _qwen(T, 3, 128, torch.float32, seed=T)
    ref = norm_then_gate_torch(x, z, w, 1e-6)
    assert got.dtype == torch.float32
    # seen: 4.5e-7 relative at most (sum order, 1/sqrt vs rsqrt, z * sigmoid(z) vs silu)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("T", [17, 129])
def test_gate_then_norm_fp32_matches_the_chain_in_odd_groups(T):
    x, z, g = _inputs(T, 3 * 37, torch.float32, seed=100 + T)
    w = 1 + 0.2 * torch.randn(3 * 37, generator=g)
    got = gated_rms_norm_triton(x, z, w, 37, 1e-5, False, torch.float32)
    ref = gate_then_norm_torch(x, z, w, 37, 1e-5, torch.float32)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))
    # each group normalised on its own: scaling one group's x leaves the other groups' outputs alone
    x2 = x.clone()
    x2[:, :37] *= 5
    again = gated_rms_norm_triton(x2, z, w, 37, 1e-5, False, torch.float32)
    torch.testing.assert_close(again[:, 37:], got[:, 37:], rtol=2e-6, atol=1e-6)


def _differing(got, ref):
    """(largest difference in bf16 ulps of the reference, fraction of elements that differ)"""
    d = (got.float() - ref.float()).abs()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(2.0**-100))) - 7)
    return float((d / ulp).max()), float((d > 0).float().mean())


def test_norm_then_gate_bf16_rounds_where_transformers_does():
    """The normalised value and the weight product each rounded to bf16 (Qwen3_5MoeRMSNormGated's casts): against
    the chain with the interpreter's truncating casts, what remains is the fp32 arithmetic flipping a rare rounding
    (seen 1.5e-5 of elements, one ulp). Rounded once at the end instead (upstream's kernel), 80 % of elements differ
    here."""
    got, x, z, w = _qwen(129, 8, 128, torch.bfloat16, seed=7)
    assert got.dtype == torch.bfloat16
    worst, frac = _differing(got, _norm_then_gate_truncated(x, z, w, 1e-6))
    assert worst <= 1 and frac <= 1e-3, (worst, frac)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_gate_then_norm_bf16_rounds_where_transformers_does(x_dtype):
    """Zamba2RMSNormGated casts the normalised value to x's dtype before the weight: bf16 for the chunked scan's y,
    nothing for the recurrence's fp32 y (then only the output's rounding)."""
    x, z, g = _inputs(129, 4 * 37, torch.bfloat16, seed=11)
    x = x.to(x_dtype)
    w = (1 + 0.2 * torch.randn(4 * 37, generator=g)).to(torch.bfloat16)
    got = gated_rms_norm_triton(x, z, w, 37, 1e-5, False, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    worst, frac = _differing(got, _gate_then_norm_truncated(x, z, w, 37, 1e-5))
    assert worst <= 1 and frac <= 1e-3, (worst, frac)


def test_cpu_tensors_keep_the_torch_chains():
    """The engines' entry points take the kernel on CUDA only: on CPU they are the chains, bit for bit, and the
    chains are transformers' modules bit for bit (fp32 and bf16)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    for dtype in (torch.float32, torch.bfloat16):
        x, z, g = _inputs(17, 4 * 24, dtype, seed=3)
        xq, zq = x.view(17, 4, 24), z.reshape(17, 4, 24)
        qwen = Qwen3_5MoeRMSNormGated(24, eps=1e-6).to(dtype)
        nemo = Zamba2RMSNormGated(4 * 24, group_size=48, eps=1e-5).to(dtype)
        with torch.no_grad():
            qwen.weight.copy_(1 + 0.2 * torch.randn(24, generator=g))
            nemo.weight.copy_(1 + 0.2 * torch.randn(4 * 24, generator=g))
            want_q, want_n = qwen(xq, zq), nemo(x, z)
        got_q = gated_norm.norm_then_gate(xq, zq, qwen.weight.detach(), 1e-6)
        got_n = gated_norm.gate_then_norm(x, z, nemo.weight.detach(), 48, 1e-5, dtype)
        assert torch.equal(got_q, want_q) and torch.equal(got_n, want_n), dtype


def test_the_entry_points_reshape_for_the_kernel():
    """What the engines call, with the kernel forced on CPU (interpreted): Qwen3.5's (T, h, d) output with its gate
    a (T, h, d) view of a strided column block, Nemotron-H's (T, N) with a strided gate; the kernel's output in the
    caller's shape and dtype, equal to the 2D launch."""
    x, z, g = _inputs(17, 3 * 128, torch.float32, seed=9)
    w = 1 + 0.2 * torch.randn(128, generator=g)
    xs, zs = x.view(17, 3, 128), z.reshape(17, 3, 128)
    got = gated_norm.norm_then_gate(xs, zs, w, 1e-6, fused=True)
    assert got.shape == xs.shape and got.dtype == torch.float32
    assert torch.equal(got.view(17, -1), gated_rms_norm_triton(x, z, w.repeat(3), 128, 1e-6, True, torch.float32))
    w2 = (1 + 0.2 * torch.randn(3 * 128, generator=g)).to(torch.bfloat16)
    got = gated_norm.gate_then_norm(x, z.to(torch.bfloat16), w2, 64, 1e-5, torch.bfloat16, fused=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, gated_rms_norm_triton(x, z.to(torch.bfloat16), w2, 64, 1e-5, False, torch.bfloat16))


def test_a_group_split_over_ranks_sums_its_squares_first():
    """TP > n_groups: each rank holds half a group; summing the halves' sums of squares (what mamba._group_sum's
    all-reduce does) gives the whole group's norm, which the fused kernel cannot, so the chain runs."""
    x, z, g = _inputs(17, 64, torch.float32, seed=5)
    w = 1 + 0.2 * torch.randn(64, generator=g)
    whole = gate_then_norm_torch(x, z, w, 64, 1e-5, torch.float32)
    halves = [slice(0, 32), slice(32, 64)]
    parts = [(x[:, s].float() * F.silu(z[:, s].float())).pow(2).sum(-1) for s in halves]
    total = parts[0] + parts[1]
    for s in halves:
        got = gated_norm.gate_then_norm(x[:, s], z[:, s], w[s], 64, 1e-5, torch.float32, lambda part: total)
        torch.testing.assert_close(got, whole[:, s], rtol=1e-6, atol=1e-6)


def test_the_interpreted_copy_leaves_the_compiled_kernel_alone():
    """CPU launches use a second copy of the vendored module loaded under the interpreter; CUDA launches the plain
    import, whose kernel stays a compiled (jit) one; TRITON_INTERPRET is left as it was."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from lpdiff.kernels.vendor.mamba_ssm import layernorm_gated

    before = os.environ.get("TRITON_INTERPRET")
    interp = gated_norm._vendored(True)
    assert os.environ.get("TRITON_INTERPRET") == before
    assert gated_norm._vendored(False) is layernorm_gated and interp is not layernorm_gated
    assert before == "1" or isinstance(layernorm_gated._layer_norm_fwd_1pass_kernel.fn.fn, JITFunction)
    assert isinstance(interp._layer_norm_fwd_1pass_kernel.fn.fn, InterpretedFunction)


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name,heads,d,group",
    [
        ("qwen3.5-35b-a3b", 32, 128, None),  # 32 value heads of 128: norm per head, then gate
        ("nemotron-3-nano", 64, 64, 512),  # inner 4096, 8 groups
        ("nemotron-3-super", 128, 64, 1024),  # inner 8192, 8 groups
    ],
)
def test_fused_norm_on_cuda(name, heads, d, group, dtype):
    """Compiled, 4096 + 33 tokens: fp32 within a few ulps of the chain; bf16 equal to the chain but for rare
    flips of a few ulps; one launch captured in a CUDA graph replays to the eager bits. Times printed (events)."""
    T, width = 4129, heads * d
    x, z, g = _inputs(T, width, dtype, seed=heads, device="cuda")
    if group is None:
        w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).cuda()
        xs, zs = x.view(T, heads, d), z.view(T, heads, d)
        fused = partial(gated_norm.norm_then_gate, xs, zs, w, 1e-6)
        chain = partial(norm_then_gate_torch, xs, zs, w, 1e-6)
    else:
        w = (1 + 0.2 * torch.randn(width, generator=g)).to(dtype).cuda()
        fused = partial(gated_norm.gate_then_norm, x, z, w, group, 1e-5, dtype)
        chain = partial(gate_then_norm_torch, x, z, w, group, 1e-5, dtype)
    got, ref = fused(), chain()
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        print(f"{name} fp32: max |d| / max |chain| {float((got - ref).abs().max() / ref.abs().max()):.2e}")
    else:
        worst, frac = _differing(got, ref)
        print(f"{name} bf16: {frac:.2e} of elements differ from the chain, at most {worst:.0f} ulp")
        # A flip is born as one ulp of the normalised value (the kernel's fp32 sum order and 1/sqrt against torch's
        # mean and rsqrt) and then goes through the weight product (|w| up to ~1.6 here) and, for Qwen3.5, the
        # gate's, each rounded again: 2 ulps at the output were seen on an H200 (Nano, 1.1e-5 of elements).
        assert worst <= 3 and frac <= 1e-3, (worst, frac)

    captured_equals_eager(fused, got)
    print(f"{name} {dtype} T={T} width {width}: fused {launch_us(fused):.1f} us, torch chain {launch_us(chain):.1f} us")
