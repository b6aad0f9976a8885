"""Mamba-2's chunked SSD scan over packed prompts, through mamba_ssm's Triton kernels (kernels/vendor/mamba_ssm/,
vendored unchanged but for their imports; its README says why vendored rather than depended on). The torch
reference beside it is ssd_varlen.ssd_scan_varlen_torch (kernels/ssd.py's chunked form, one prompt per row).

Why use theirs: a prompt of L tokens costs ssd_varlen's recurrence L dependent steps per (prompt, head) program;
the chunked form (state-space duality) does the same map as matmuls inside chunks of ``chunk`` tokens plus a short
recurrence over chunk states, which is how vLLM and SGLang run Nemotron-H (both carry adapted copies of these
kernels). mamba_ssm is the kept original; writing our own would only add another copy to keep correct.

Packed prompts: ``seq_idx`` (T,) gives each token's prompt. The kernels mask every term that would couple two
prompts (the intra-chunk C.B matrix, a chunk's state contribution, the state passed into the next chunk), so each
prompt starts from a zero state although chunks are laid over the pack without regard to its boundaries.

Rounding: x, B, C enter the dots in their own dtype, and the state handed from chunk to chunk and y are rounded to
C's and x's dtype (as upstream's mamba_chunk_scan_combined does): in bf16 ~1 ulp at the top of |y| (0.4 %), where the
recurrence accumulates and returns fp32. fp32 inputs would enter tl.dot at TF32 on a GPU (its default, 10-bit
mantissas: 1.9e-3 of max |y| at Nano's shapes), which would break the runtime's fp32 parity (~1e-6), so their compiled
launches run with TRITON_F32_DEFAULT=ieee (dot_env). Triton reads it when it compiles; its on-disk cache key holds
it, and its in-process cache keys on argument dtypes, whose fp32 variants are only ever compiled under it here. The
interpreter's fp32 dots are exact: on CPU this path agrees with the fp32 reference to ~1e-6 relative
(tests/kernels/test_ssd_chunked.py). It cannot check 16-bit inputs on CPU: Triton 3.6's interpreter multiplies
bf16/fp16 dot operands as raw bits (kernels._triton.dot_flags), so that is the gpu1 test's.

CPU tensors run a second copy of the kernels through the Triton interpreter (loaded with TRITON_INTERPRET=1 under its
own module name, as kernels._triton.DualKernel does for lpdiff's kernels), each autotuner cut to one config through
mamba_ssm's own deterministic-mode switch (MAMBA_DETERMINISTIC=1 at import), so nothing is benchmarked there.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from lpdiff.kernels._triton import _jit_calls_interpreted, interpreting

VENDOR = "lpdiff.kernels.vendor.mamba_ssm"
INTERPRETED = VENDOR + "_interpreted"  # the interpreted copy's package name
MODULES = ("ssd_chunk_state", "ssd_state_passing", "ssd_bmm", "ssd_chunk_scan")
_LOADED: dict[bool, SimpleNamespace] = {}


def _setenv(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _env(**values: str | None):
    old = {k: os.environ.get(k) for k in values}
    try:
        _setenv(values)
        yield
    finally:
        _setenv(old)


def _load_interpreted() -> SimpleNamespace:
    found = importlib.util.find_spec(VENDOR)
    assert found is not None and found.origin is not None
    folder = Path(found.origin).parent
    spec = importlib.util.spec_from_file_location(
        INTERPRETED, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[INTERPRETED] = package
    spec.loader.exec_module(package)
    # triton.jit reads TRITON_INTERPRET and mamba_ssm's autotune_configs MAMBA_DETERMINISTIC when each kernel is
    # decorated, i.e. at import; TRITON_CACHE_AUTOTUNING=1 would keep every config. The switch warns once: silenced.
    with _env(TRITON_INTERPRET="1", MAMBA_DETERMINISTIC="1", TRITON_CACHE_AUTOTUNING=None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SimpleNamespace(**{m: importlib.import_module(f"{INTERPRETED}.{m}") for m in MODULES})


def vendored(interpret: bool) -> SimpleNamespace:
    """The vendored kernel modules: compiled (CUDA tensors) or interpreted (CPU tensors), each imported once."""
    if interpret not in _LOADED:
        if interpret:
            _LOADED[interpret] = _load_interpreted()
        else:
            _LOADED[interpret] = SimpleNamespace(**{m: importlib.import_module(f"{VENDOR}.{m}") for m in MODULES})
    return _LOADED[interpret]


@contextlib.contextmanager
def _cpu_device_guard(interpret: bool):
    """Interpreted launches: the vendored launchers enter ``torch.cuda.device(x.device.index)``, and a CPU tensor's
    index is None, which torch 2.13 rejects ('<' between None and int), so a no-op stands in for it; and triton's
    own jit helpers (tl.cumsum) run interpreted too (kernels._triton's shim for lpdiff's kernels)."""
    if not interpret:
        yield
        return
    original = torch.cuda.device
    torch.cuda.device = lambda index: contextlib.nullcontext()  # type: ignore[assignment,misc,return-value]
    try:
        with _jit_calls_interpreted():
            yield
    finally:
        torch.cuda.device = original  # type: ignore[misc]


def dot_env(dtype: torch.dtype, interpret: bool) -> dict[str, str]:
    """The environment a launch of the compiled kernels runs under: fp32 inputs get IEEE fp32 dots. bf16/fp16 runs
    feed the dots only their own dtype (every operand is cast to x's or C's dtype first), so they are left alone."""
    return {"TRITON_F32_DEFAULT": "ieee"} if dtype == torch.float32 and not interpret else {}


def ssd_scan_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    seq_idx: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """x (T, h, p), dt (T, h) discretised (ssd.discretise_dt), A (h,), B/C (T, g, n), D (h,), seq_idx (T,) int32
    prompt index of each token (non-decreasing), chunk (tokens per chunk, the model's chunk_size) -> y (T, h, p) in
    x's dtype, each prompt from a zero state: ssd_varlen.ssd_scan_varlen's map, chunked.

    The five launches of upstream's ssd_combined._mamba_chunk_scan_combined_fwd (no z, no initial state, dt already
    discretised so no dt_bias / softplus / limit), with its einops reshapes of the chunk states written as views."""
    T, h, p = x.shape
    n = B.shape[2]
    assert dt.shape == (T, h) and A.shape == (h,) and D.shape == (h,) and C.shape == B.shape and seq_idx.shape == (T,)
    interpret = x.device.type != "cuda" or interpreting()
    ops = vendored(interpret)
    if x.stride(-1) != 1 and x.stride(0) != 1:  # upstream's layout checks, on the batch of one
        x = x.contiguous()
    B, C, D = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C, D))
    x4, dt3, B4, C4 = x[None], dt[None], B[None], C[None]
    s2 = seq_idx.to(torch.int32)[None]
    with _cpu_device_guard(interpret), _env(**dot_env(x.dtype, interpret)):
        dA_cumsum, dt_chunks = ops.ssd_chunk_state._chunk_cumsum_fwd(dt3, A, chunk)
        states = ops.ssd_chunk_state._chunk_state_fwd(B4, x4, dt_chunks, dA_cumsum, seq_idx=s2, states_in_fp32=True)
        nchunks = states.shape[1]
        states, _ = ops.ssd_state_passing._state_passing_fwd(
            states.view(1, nchunks, h, p * n), dA_cumsum[:, :, :, -1], seq_idx=s2, chunk_size=chunk, out_dtype=C.dtype
        )
        states = states.view(1, nchunks, h, p, n)
        cb = ops.ssd_bmm._bmm_chunk_fwd(C4, B4, chunk, seq_idx=s2, output_dtype=torch.float32)
        out, _ = ops.ssd_chunk_scan._chunk_scan_fwd(cb, x4, dt_chunks, dA_cumsum, C4, states, D=D, seq_idx=s2)
    return out[0]
