"""No kernel, torch reference or runtime layer reads memory it did not write (issue 40, item 1).

A CUDA caching allocator hands back freed blocks with their old contents, and on some CPUs a bf16 GEMM into a
strided column block (``torch.mm(..., out=C[:, lo:hi])``) scales C by beta = 0 instead of ignoring it, so NaN
already in C survives. Neither happens on every machine, which made test outcomes depend on the CPU. Here both
are forced on every machine:

- ``poisoned_alloc``: torch.empty / torch.empty_like / Tensor.new_empty hand back NaN-filled float tensors
  (integer ones filled with -7, an out-of-range id), as a reused block may hold;
- ``blas_reading_c``: torch.mm(out=C) computes 0 * C + A B, the behaviour of the CPU where it was seen (a
  stand-in: no CPU this suite runs on reproduces it, ``ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41``
  included; the real torch.mm does the product).

A run under both must be bit-identical to a clean run: the triton engine on CPU (kernels/ through the Triton
interpreter, dense LoRA on the vendor-GEMM paths, a mixed batch with rows without an adapter, a one-adapter
batch) in fp32 and bf16, and its torch references.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.kernels.lora_linear import augment_weight, lora_linear_aug, pack_lora_b, slot_one_hot
from tests.helpers.lora_linear import make_linear


def _garbage(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(True) if t.dtype == torch.bool else t.fill_(-7)


@pytest.fixture
def poisoned_alloc(monkeypatch):
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _garbage(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _garbage(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: _garbage(new_empty(self, *a, **k)))


@pytest.fixture
def blas_reading_c(monkeypatch):
    mm = torch.mm
    calls = []

    def mm_beta0_reads_c(a, b, *, out=None):
        if out is None:
            return mm(a, b)
        calls.append(out.shape)
        old = out.clone()
        mm(a, b, out=out)
        return out.add_(old * 0)

    monkeypatch.setattr(torch, "mm", mm_beta0_reads_c)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_linear_aug_ignores_what_its_buffer_held(dtype, blas_reading_c):
    """The q|k|v LoRA's shrink columns hold NaN before the call (a reused buffer): the masked and the one-slot
    branch must give the result of a zero-filled buffer, bit for bit."""
    p = make_linear(T=37, kin=40, widths=(24, 8, 12), L=3, R=16, dtype=dtype, seed=3)
    L, S, R, kin = p["lora_a"].shape
    w_aug = augment_weight(p["w"], pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"], R))
    mask = slot_one_hot(p["token_adapter"], L, dtype)
    for kw in (dict(slot_mask=mask), dict(uniform_slot=1)):
        got = []
        for fill in (0.0, float("nan")):
            xa = torch.full((p["x"].shape[0], kin + L * S * R), fill, dtype=dtype)
            xa[:, :kin] = p["x"]
            got.append(lora_linear_aug(xa, w_aug, p["bias"], p["lora_a"], **kw))
        assert torch.isfinite(got[1]).all(), f"{kw.keys()}: NaN from the buffer reached the output"
        assert torch.equal(got[0], got[1])
    assert blas_reading_c, "the out= GEMM this test guards was not called"


def _forward(spec, adapters, prompts, choices, dtype, impl):
    from lpdiff.engines.triton import TritonEngine

    cfg = EngineConfig(model=spec, adapters=adapters["triton"], dtype=dtype, device="cpu", options={"impl": impl})
    with TritonEngine(cfg) as eng:
        return [[np.asarray(r.logprobs) for r in eng.prompt_logprobs(prompts, c)] for c in choices]


@pytest.mark.parametrize("tiny", ["qwen3_moe"], indirect=True)  # the interpreter's cost: one arch
# bf16 on the kernels (where the CPU let NaN through), fp32 on the references: two forwards per case, 12-25 s on
# 2 shared cores
@pytest.mark.parametrize("dtype,impl", [("bfloat16", "triton"), ("float32", "torch")])
def test_triton_engine_forward_ignores_what_the_allocator_hands_back(tiny, dtype, impl, request):
    """A clean forward, then the same forward with every torch.empty NaN-filled and the BLAS reading C: equal
    bit for bit, and finite."""
    spec, adapters, prompts = tiny
    short = [p[:5] for p in prompts[:4]]  # the interpreter's cost grows with the grid
    choices = [["attn_experts", None, "shared_outer", "experts_pe"], "shared_outer"]
    clean = _forward(spec, adapters, short, choices, dtype, impl)
    request.getfixturevalue("poisoned_alloc")
    calls = request.getfixturevalue("blas_reading_c")
    dirty = _forward(spec, adapters, short, choices, dtype, impl)
    assert impl == "torch" or calls, "the mixed batch did not reach the out= GEMM"
    for c, a, b in zip(choices, clean, dirty):
        for i, (x, y) in enumerate(zip(a, b)):
            assert np.isfinite(y).all(), f"choice {c}, prompt {i}: NaN from an uninitialised buffer"
            assert np.array_equal(x, y), f"choice {c}, prompt {i}: max |d| {np.abs(x - y).max():.3g}"
