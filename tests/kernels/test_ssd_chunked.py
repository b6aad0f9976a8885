"""kernels/ssd_chunked.py (mamba_ssm's chunked SSD kernels, vendored in kernels/vendor/mamba_ssm/) against the torch
reference (ssd_varlen.ssd_scan_varlen_torch: kernels/ssd.py's chunked form, one prompt per padded row).

CPU: the kernels interpreted, fp32 (the interpreter's bf16 dots multiply raw bits: kernels._triton.dot_flags), on
packed prompts of odd lengths whose boundaries fall inside chunks, on them, and at the pack's end, a one-token prompt
among them, head_dim and state sizes that are not powers of two, two heads per group, x / B / C as strided views.
GPU (gpu1): compiled, bf16 and fp32, at Nemotron-3-Nano's mixer shapes, against the reference and the recurrence."""

from __future__ import annotations

import os

import pytest
import torch

from lpdiff.kernels import ssd_chunked
from lpdiff.kernels.ssd_chunked import ssd_scan_chunked
from lpdiff.kernels.ssd_varlen import ssd_scan_varlen, ssd_scan_varlen_torch
from tests.helpers.ssd import scan_inputs

LENS = [16, 1, 5, 37, 21]  # 80 tokens, chunk 16: boundaries on a chunk edge (16, 80) and inside chunks (17, 22, 59)


def _ref(s, cu=None):
    return ssd_scan_varlen_torch(*s.args(), s.cu_seqlens if cu is None else cu, chunk=8)


def test_packed_prompts_match_the_reference_in_fp32():
    s = scan_inputs(LENS, h=4, p=6, g=2, n=12, seed=1)
    assert not s.x.is_contiguous() and not s.B.is_contiguous()
    got = ssd_scan_chunked(*s.args(), s.seq_idx, chunk=16)
    ref = _ref(s)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # seen: 2.3e-5 of max |y| 22 (the recurrence kernel: 3.8e-6); upstream takes exp of differences of cumulative
    # decay sums, which lose low digits that the reference's segsum keeps
    tol = 1e-5 * float(ref.abs().max())
    assert float((got - ref).abs().max()) <= tol, float((got - ref).abs().max())

    # each prompt starts from a zero state: the same pack scanned as one prompt differs after the first prompt by
    # far more than the tolerance (so a seq_idx the kernels ignored would fail above), and matches the reference's
    # one-prompt scan
    whole = _ref(s, torch.tensor([0, sum(LENS)], dtype=torch.int32))
    one = ssd_scan_chunked(*s.args(), torch.zeros_like(s.seq_idx), chunk=16)
    assert float((one - whole).abs().max()) <= tol
    assert float((whole[LENS[0] :] - ref[LENS[0] :]).abs().max()) > 1e3 * tol


def test_chunk_larger_than_the_pack_and_a_single_prompt():
    """One prompt shorter than a chunk (the model's chunk_size 128 against a short prompt), and the recurrence
    kernel on the same inputs: three implementations, one map."""
    s = scan_inputs([45], h=2, p=8, g=1, n=16, seed=2)
    got = ssd_scan_chunked(*s.args(), s.seq_idx, chunk=64)
    ref = _ref(s)
    tol = 1e-5 * float(ref.abs().max())
    assert float((got - ref).abs().max()) <= tol
    rec = ssd_scan_varlen(*s.args(), s.cu_seqlens, impl="triton")
    assert float((rec - ref).abs().max()) <= tol


def test_the_interpreted_copy_leaves_the_compiled_kernels_alone():
    """CPU launches load a second, interpreted copy of the vendored modules with every autotuner cut to one config;
    the plain import (what CUDA launches use) keeps upstream's configs, and the environment is left as it was."""
    from lpdiff.kernels.vendor.mamba_ssm import (
        determinism,
        softplus,
        ssd_bmm,
        ssd_chunk_scan,
        ssd_chunk_state,
        ssd_state_passing,
    )

    before = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "MAMBA_DETERMINISTIC")}
    interp = ssd_chunked.vendored(True)
    assert {k: os.environ.get(k) for k in before} == before
    pairs = [
        (ssd_chunk_state._chunk_cumsum_fwd_kernel, interp.ssd_chunk_state._chunk_cumsum_fwd_kernel),
        (ssd_chunk_state._chunk_state_fwd_kernel, interp.ssd_chunk_state._chunk_state_fwd_kernel),
        (ssd_state_passing._state_passing_fwd_kernel, interp.ssd_state_passing._state_passing_fwd_kernel),
        (ssd_bmm._bmm_chunk_fwd_kernel, interp.ssd_bmm._bmm_chunk_fwd_kernel),
        (ssd_chunk_scan._chunk_scan_fwd_kernel, interp.ssd_chunk_scan._chunk_scan_fwd_kernel),
    ]
    if not determinism.use_deterministic_mode():  # upstream's own switch would cut the compiled copy too
        for compiled, interpreted in pairs:
            assert len(compiled.configs) > 1 and len(interpreted.configs) == 1, compiled.base_fn.__name__
    assert ssd_chunk_state.softplus is softplus.softplus
    assert interp.ssd_chunk_state.softplus is not softplus.softplus
    assert ssd_chunked.vendored(False).ssd_chunk_scan is ssd_chunk_scan


def test_fp32_launches_compile_ieee_dots(monkeypatch):
    """fp32 on a GPU: the compiled launches run with TRITON_F32_DEFAULT=ieee (TF32 dots cost 1.9e-3 of max |y| at
    Nano's shapes, the runtime's fp32 parity needs ~1e-6); 16-bit runs and the interpreter (exact fp32) keep
    triton's default, and the caller's environment comes back as it was. The launch itself is interpreted here
    (no GPU), with dot_env forced, to see that the kernels are launched inside the environment it names."""
    import triton

    assert ssd_chunked.dot_env(torch.float32, interpret=False) == {"TRITON_F32_DEFAULT": "ieee"}
    assert ssd_chunked.dot_env(torch.bfloat16, interpret=False) == {}
    assert ssd_chunked.dot_env(torch.float16, interpret=False) == {}
    assert ssd_chunked.dot_env(torch.float32, interpret=True) == {}

    seen = []
    ops = ssd_chunked.vendored(True)
    bmm = ops.ssd_bmm._bmm_chunk_fwd

    def spy(*args, **kwargs):
        seen.append(triton.knobs.language.fp32_default)
        return bmm(*args, **kwargs)

    monkeypatch.setattr(ops.ssd_bmm, "_bmm_chunk_fwd", spy)
    monkeypatch.setattr(ssd_chunked, "dot_env", lambda dtype, interpret: {"TRITON_F32_DEFAULT": "ieee"})
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    s = scan_inputs([9, 4], h=2, p=4, g=1, n=8, seed=4)
    ssd_scan_chunked(*s.args(), s.seq_idx, chunk=8)
    assert seen == ["ieee"] and "TRITON_F32_DEFAULT" not in os.environ


def test_the_rounding_emulation_is_the_scan_when_it_rounds_nothing():
    """tests/helpers/ssd_rounding.py (mamba_ssm's bf16 roundings in torch, for CPU measurements): in fp32 it is
    kernels/ssd.ssd_scan's map (seen ~1e-7 of max |y|), and in bf16 it moves y by about one bf16 ulp of max |y|."""
    from lpdiff.kernels.ssd import ssd_scan
    from tests.helpers.ssd_rounding import ssd_scan_rounded

    g = torch.Generator().manual_seed(5)
    x, B, C = (torch.randn(2, 45, *shape, generator=g) for shape in ((4, 6), (2, 12), (2, 12)))
    dt = torch.rand(2, 45, 4, generator=g) * 0.5 + 0.01
    A, D = -torch.rand(4, generator=g) - 0.5, torch.randn(4, generator=g)
    ref = ssd_scan(x, dt, A, B, C, 16, D)
    scale = float(ref.abs().max())
    assert float((ssd_scan_rounded(x, dt, A, B, C, 16, D, torch.float32) - ref).abs().max()) <= 1e-5 * scale
    xb, Bb, Cb = x.bfloat16(), B.bfloat16(), C.bfloat16()
    ref_b = ssd_scan(xb, dt, A, Bb, Cb, 16, D)  # the same bf16 inputs, fp32 inside
    err = float((ssd_scan_rounded(xb, dt, A, Bb, Cb, 16, D).float() - ref_b).abs().max())
    assert 2**-10 * scale <= err <= 2**-6 * scale, err / scale


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
@pytest.mark.parametrize("lens", [[512] * 8, [300, 17, 1024, 1, 64, 129]])
def test_nemotron_nano_shapes_on_cuda(lens):
    """Nemotron-3-Nano's mixer (64 heads of 64, 8 groups, state 128, chunk 128), compiled: bf16 against the fp32
    reference on the same bf16 inputs (upstream hands chunk states on in bf16, and y is bf16), and against the
    recurrence kernel; fp32 with IEEE dots (dot_env) within 1e-4 of max |y|: ~1e-6 relative is expected (the CPU
    test's exact dots), 1e-4 leaves room for the exp of cumulative-sum differences over 128-token chunks, and TF32
    dots (seen 0.633 of max |y| 336, 1.9e-3 relative) would fail it."""
    s = scan_inputs(lens, h=64, p=64, g=8, n=128, dtype=torch.bfloat16, device="cuda", seed=3)
    ref = ssd_scan_varlen_torch(*(t.float() for t in s.args()), s.cu_seqlens, chunk=64)
    got = ssd_scan_chunked(*s.args(), s.seq_idx, chunk=128)
    assert got.dtype == torch.bfloat16
    scale = float(ref.abs().max())
    err = float((got.float() - ref).abs().max())
    rec = ssd_scan_varlen(*s.args(), s.cu_seqlens, impl="triton")
    if len(set(lens)) == 1 and lens[0] % 128 == 0:  # whole chunks per prompt: the emulation's chunks are the kernels'
        from tests.helpers.ssd_rounding import ssd_scan_rounded

        rows = [t.view(len(lens), lens[0], *t.shape[1:]) for t in (s.x, s.dt, s.B, s.C)]
        emu = ssd_scan_rounded(*rows[:2], s.A, *rows[2:], 128, s.D).reshape(got.shape)
        rms_emu, rms_got = ((t.float() - ref).pow(2).mean().sqrt() for t in (emu, got))
        print(f"lens {lens}: rms error, emulated rounding {rms_emu:.3g}, chunked kernels {rms_got:.3g}")
        # the CPU measurements of what the kernels' bf16 rounding costs end to end stand on this (options.py)
        assert 0.5 <= float(rms_emu / rms_got) <= 2
    print(f"lens {lens}: max |y| {scale:.3g}, chunked bf16 {err:.3g}, recurrence bf16 {(rec - ref).abs().max():.3g}")
    assert err <= 2e-2 * scale
    assert float((got.float() - rec.float()).abs().max()) <= 2e-2 * scale
    s32 = scan_inputs(lens, h=64, p=64, g=8, n=128, dtype=torch.float32, device="cuda", seed=3)
    ref32 = ssd_scan_varlen_torch(*s32.args(), s32.cu_seqlens, chunk=64)
    got32 = ssd_scan_chunked(*s32.args(), s32.seq_idx, chunk=128)
    err32 = float((got32 - ref32).abs().max())
    print(f"lens {lens}: fp32 (IEEE dots) chunked {err32:.3g} of max |y| {float(ref32.abs().max()):.3g}")
    assert err32 <= 1e-4 * float(ref32.abs().max())
