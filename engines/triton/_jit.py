"""When the runtime's own small fused kernels (norm, rope, router) run as Triton and when as their torch
references. They are plain ``triton.jit`` kernels: compiled on CUDA tensors, interpreted on CPU tensors only when
TRITON_INTERPRET=1 was set before this package was imported (the interpreter cannot run triton's own jit helpers
such as tl.sum inside a kernel compiled for the GPU, so the mode is fixed at import)."""

from __future__ import annotations

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without triton run the torch references
    triton = tl = None


def use_triton(x: torch.Tensor, impl: str) -> bool:
    return triton is not None and impl != "torch" and (x.is_cuda != INTERPRETED)


def pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()
