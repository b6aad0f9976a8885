"""The hybrids' gated RMSNorm, fused: one Triton pass reading x and the gate once and writing the output once, with
the torch chains it replaces beside it as the reference and the CPU path.

Two semantics, both transformers':
- Qwen3.5's Gated DeltaNet (Qwen3_5MoeRMSNormGated): weight * rmsnorm(x) * silu(gate), the norm over each head's
  head_dim, weight (head_dim,) shared by the heads (``norm_then_gate``).
- Nemotron-H's Mamba-2 mixer (MambaRMSNormGated / Zamba2RMSNormGated): rmsnorm(x * silu(z)) * weight, the norm over
  each group of ``group_size`` columns (``gate_then_norm``); under tensor parallelism a group wider than one rank's
  columns needs its sum of squares summed over the ranks first, which only the torch chain does (``sum_squares``).

The kernel is mamba_ssm's ``_layer_norm_fwd`` (mamba_ssm 2.3.2.post1, ops/triton/layernorm_gated.py, its forward
vendored in kernels/vendor/mamba_ssm/; README there), which covers both: z gate, group_size, norm_before_gate,
is_rms_norm. Why theirs: it is the kept original of this exact op (vLLM carries a copy in
model_executor/layers/mamba/ops/layernorm_gated.py; fla-core 0.5.2 ships another as fla.modules.layernorm_gated, but
fla is a GPU-only extra here, so the CPU tests could not run it; fla's fused_norm_gate gates after the norm of whole
rows only, so it cannot do Nemotron's grouped gate-before-norm). One launch per call, grid (rows, groups), a program
per (row, group) holding the group in registers; nothing is read back to the host and every buffer's size follows the
shapes only, so it captures in a CUDA graph.

Rounding. transformers' chains round in 16 bits where the kernel, as upstream wrote it, would not: the normalised
value is cast to x's dtype before the weight multiplies it, and (Qwen3.5) the weight product is rounded to the
output dtype before the fp32 silu(gate) multiplies it. Rounded once at the end instead, bf16 outputs would differ
from the chain's in 25-35 % of elements by 1-3 ulps (measured in torch at 4096 x 32 x 128 and 4096 x 4096 in groups
of 512, fresh normal inputs). So lpdiff adds those two roundings to the vendored kernel (ROUND_NORMED,
ROUND_PRODUCT; the README lists the change), and what remains is the kernel's fp32 arithmetic against torch's (its
sum order and 1/sqrt against mean and rsqrt, z * sigmoid(z) against silu): a few fp32 ulps, which flip a bf16
rounding in ~1.5e-5 of elements by one ulp (CPU, interpreted, against the chain with the interpreter's truncating
bf16 casts emulated; tests/kernels/test_gated_norm.py). fp32 runs compute in fp32 throughout (no dots, so no TF32):
4.5e-7 relative to the chain at most on CPU.

The fused path is taken for CUDA tensors only; CPU runs keep the torch chains (the reference's own arithmetic), so
CPU parity tests are unchanged by it.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lpdiff.kernels._triton import interpreting
from lpdiff.kernels.ssd_chunked import VENDOR, _cpu_device_guard, _env

_MODULE = "layernorm_gated"
_LOADED: dict[bool, object] = {}


def norm_then_gate_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., d) -> weight * rmsnorm(x) * silu(gate), rounded as transformers' Qwen3_5MoeRMSNormGated: the norm in
    fp32, cast to x's dtype before the weight, the gate's silu in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def gate_then_norm_torch(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out_dtype: torch.dtype,
    sum_squares: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(..., N) -> RMSNorm over each ``group_size`` columns of x * silu(z), in fp32, times weight (N,), rounded as
    transformers' Zamba2RMSNormGated: the normalised value cast to x's dtype before the weight. A group wider than N
    (one tensor-parallel rank's share of it): ``sum_squares`` maps this share's (...,) sum of squares to the whole
    group's."""
    h = x.float() * F.silu(z.float())
    shape = h.shape
    if shape[-1] < group_size:
        assert sum_squares is not None, f"a group of {group_size} over {shape[-1]} columns needs sum_squares"
        mean = sum_squares(h.pow(2).sum(-1)) / group_size
        return (weight * (h * torch.rsqrt(mean[..., None] + eps)).to(x.dtype)).to(out_dtype)
    hg = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * hg.view(shape).to(x.dtype)).to(out_dtype)


def _vendored(interpret: bool):
    """mamba_ssm's layernorm_gated module: compiled, or a second copy loaded with TRITON_INTERPRET=1 under its own
    name for CPU tensors (as ssd_chunked loads the SSD kernels; the file imports nothing of its package)."""
    if interpret not in _LOADED:
        if not interpret:
            _LOADED[interpret] = importlib.import_module(f"{VENDOR}.{_MODULE}")
        else:
            found = importlib.util.find_spec(VENDOR)
            assert found is not None and found.origin is not None
            name = f"{VENDOR}_interpreted_{_MODULE}"
            spec = importlib.util.spec_from_file_location(name, Path(found.origin).parent / f"{_MODULE}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            with _env(TRITON_INTERPRET="1"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                spec.loader.exec_module(module)
            _LOADED[interpret] = module
    return _LOADED[interpret]


def gated_rms_norm_triton(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    norm_before_gate: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x, z (M, N) (any float dtypes, z may be a strided view with unit column stride), weight (N,) -> (M, N) in
    ``out_dtype``: per row, each group of ``group_size`` columns normalised (RMS, fp32) -- after x * silu(z) when
    ``norm_before_gate`` is False (Nemotron-H), before the product with silu(z) otherwise (Qwen3.5) -- times
    weight, with the torch chains' roundings (module docstring). One launch of the vendored kernel; CPU tensors run
    it interpreted."""
    M, N = x.shape
    assert z.shape == (M, N) and weight.shape == (N,) and N % group_size == 0, (x.shape, z.shape, weight.shape)
    product = torch.promote_types(weight.dtype, x.dtype)  # the dtype of the chains' weight * normalised value
    assert product in (torch.float32, out_dtype), (weight.dtype, x.dtype, out_dtype)
    x, z, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, z, weight))
    interpret = x.device.type != "cuda" or interpreting()
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    with _cpu_device_guard(interpret):
        _vendored(interpret)._layer_norm_fwd(
            x, weight, None, eps, z=z, out=out, group_size=group_size, norm_before_gate=norm_before_gate,
            is_rms_norm=True, round_normed=x.dtype != torch.float32,
            # Nemotron's product is the output (its one rounding is the store's); Qwen3.5's is rounded before the gate
            round_product=norm_before_gate and product != torch.float32,
        )  # fmt: skip
    return out


def norm_then_gate(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool | None = None
) -> torch.Tensor:
    """Qwen3.5's gated norm: x, gate (..., h, d), weight (d,) -> (..., h, d) in x's dtype. Fused (``fused``; None:
    on CUDA tensors) as one row of h groups of d per token, weight repeated per head (h * d elements); the torch
    chain otherwise."""
    if not (x.is_cuda if fused is None else fused) or x.dim() < 2:
        return norm_then_gate_torch(x, gate, weight, eps)
    h, d = x.shape[-2:]
    out = gated_rms_norm_triton(x.reshape(-1, h * d), gate.reshape(-1, h * d), weight.repeat(h), d, eps, True, x.dtype)
    return out.view(x.shape)


def gate_then_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out_dtype: torch.dtype,
    sum_squares: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Nemotron-H's gated norm (gate_then_norm_torch's map): fused (``fused``; None: on CUDA tensors) when each
    group lies within the columns given; a group split over tensor-parallel ranks takes the torch chain."""
    if not (x.is_cuda if fused is None else fused) or x.shape[-1] < group_size:
        return gate_then_norm_torch(x, z, weight, group_size, eps, out_dtype, sum_squares)
    N = x.shape[-1]
    out = gated_rms_norm_triton(x.reshape(-1, N), z.reshape(-1, N), weight, group_size, eps, False, out_dtype)
    return out.view(*x.shape[:-1], N)
