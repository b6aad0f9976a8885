"""What every kernel file shares: picking torch or Triton, running one Triton kernel either compiled (CUDA
tensors) or interpreted (CPU tensors) in the same process whatever TRITON_INTERPRET said at import time, the
interpreter shims that keep the kernels running on Triton 3.6 through 3.9, and small launch helpers."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

try:  # triton is optional: without it every op runs its torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

IMPLS = ("auto", "triton", "torch")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_impl(impl: str, x: torch.Tensor | torch.device) -> str:
    """'auto' means Triton on CUDA tensors (or a CUDA device) or under TRITON_INTERPRET=1, the torch reference
    otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        cuda = x.type == "cuda" if isinstance(x, torch.device) else x.is_cuda
        impl = "triton" if (cuda or interpreting()) else "torch"
    if impl == "triton" and triton is None:
        raise RuntimeError("impl='triton' needs the triton package (pip install triton), or pass impl='torch'")
    return impl


class DualKernel:
    """A Triton kernel launched compiled for CUDA tensors and through the interpreter for CPU tensors.

    triton.jit decides at decoration time from TRITON_INTERPRET, so a module imported before a test set the
    variable would be stuck on one path; holding both lets CPU tests and GPU runs share one import. Helpers the
    kernel calls stay plain @triton.jit functions: during an interpreted launch they run interpreted too."""

    def __init__(self, fn):
        self.fn = fn
        self.jit = triton.jit(fn)
        self._interp = None

    def __getitem__(self, grid_and_device):
        grid, device = grid_and_device
        if device.type == "cuda" and not interpreting():
            return self.jit[grid]
        if self._interp is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interp = InterpretedFunction(self.fn)
        launch = self._interp[grid]

        def run(*args, **kwargs):
            with _jit_calls_interpreted():
                return launch(*args, **kwargs)

        return run


@contextmanager
def _jit_calls_interpreted():
    """Let compiled-mode @triton.jit helpers (ours, tl.zeros, tl.cumsum, ...) be called from interpreted code, as
    they would be had TRITON_INTERPRET=1 been set before triton was imported."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    cache: dict = {}

    def call(jf, *args, **kwargs):
        interp = cache.get(id(jf))  # by id: hashing a JITFunction parses its source, which fails mid-interpretation
        if interp is None:  # the first call patches triton.language for it, and nothing undoes that within a launch
            interp = cache[id(jf)] = InterpretedFunction(jf.fn)
            return interp(*args, **kwargs)
        # later calls skip re-patching, 12-15 % of an interpreted MoE forward's CPU (538 patches of 5 modules each)
        rewritten = getattr(interp, "rewrite", None)
        return rewritten()(*args, **kwargs) if rewritten else interp(*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


def dual_jit(fn):
    return DualKernel(fn)


def _patch_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``, and its scalars (program ids,
    loaded values) are (1,)-shaped numpy arrays, which numpy 2.4 no longer converts: any loop bounded by one
    (``range(lo, hi)`` with lo from a program id or a load) failed with "only 0-dimensional arrays can be converted
    to Python scalars". Convert the array's single element instead; compiled kernels are not affected."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_lpdiff", False):  # another triton's layout, or patched already
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.__dict__["_lpdiff"] = True  # the mark the getattr above finds on a second call
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_masks() -> None:
    """The interpreter keeps a comparison's result under its operands' dtype (a bool array tagged int32), so a
    scalar condition splatted onto a tile (``(offs < n) & (a >= 0)``) becomes an int32 array of 0/1. Triton 3.6's
    load and store read any integer mask as a truth value; 3.9's reject it ("mask has unsupported dtype"). Hand
    them a bool view of the same 0/1 values, as the compiled kernel's i1 mask is; compiled kernels are not
    affected."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    if getattr(InterpreterBuilder.create_masked_load, "_lpdiff", False):
        return

    def as_bool(mask):  # a TensorHandle, or a plain array from a block pointer's or descriptor's bounds
        if isinstance(mask, TensorHandle) and mask.data.dtype != bool:
            return TensorHandle(mask.data != 0, mask.dtype)
        return mask

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, *args, **kwargs):
        return load(self, ptrs, as_bool(mask), *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    masked_load.__dict__["_lpdiff"] = masked_store.__dict__["_lpdiff"] = True  # found by the getattr above
    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = masked_load, masked_store


if triton is not None:
    _patch_interpreter_scalars()
    _patch_interpreter_masks()


def dot_flags(dtype: torch.dtype, device: torch.device) -> dict:
    """IEEE fp32 dots for fp32 inputs (tf32 would break exact parity with the fp32 reference); the interpreter
    multiplies raw bits for bf16/fp16 dots, so there the tiles are upcast to fp32 first."""
    interp = device.type != "cuda" or interpreting()
    return dict(DOT_PREC="ieee" if dtype == torch.float32 else "tf32", UPCAST=bool(interp and dtype != torch.float32))


def next_pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


_CONST_CACHE: dict = {}


def _cached(key: tuple, make) -> torch.Tensor:
    """A small device tensor made once per key and reused by every launch after."""
    if key not in _CONST_CACHE:
        _CONST_CACHE[key] = make()
    return _CONST_CACHE[key]


def device_const(values: tuple, device: torch.device) -> torch.Tensor:
    """A small int32 tensor built once per (values, device): building it per call would be a host-to-device copy."""
    return _cached(("const", values, str(device)), lambda: torch.tensor(values, dtype=torch.int32, device=device))


def placeholder(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A never-read stand-in for an absent tensor argument, allocated once per (shape, dtype, device): an
    allocation per launch costs microseconds of host time, and the runtime's LoRA path is host-bound."""
    return _cached(("placeholder", shape, dtype, str(device)), lambda: torch.empty(shape, dtype=dtype, device=device))
