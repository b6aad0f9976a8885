"""Batched dense LoRA linear (attention, linear-attention, mamba and shared-expert projections): several adapters
per batch, rows with none, outputs split into slices (q|k|v, gate|up) that each have their own A.

Shapes: T tokens, Kin input width, N output width, S slices, R max rank, L adapter slots, M padded rows.

Two Triton paths, both on the grouped GEMM of fused_moe_lora.py with one "expert": tokens are sorted by adapter
slot and padded to the block size, so every tile has one adapter; the shrink writes S*R columns per row (scaled).
- default: the base GEMM is cuBLAS (F.linear in the run dtype, IEEE fp32 for fp32 runs), then one pass adds, for
  each slice that overlaps an output tile, S[:, s*R:(s+1)*R] B[a, lo_s:hi_s]^T to that tile in place. The base
  is the big cost and cuBLAS runs it near peak; the delta pass is memory-bound (one read and write of the
  adapter rows of out), and rows without an adapter are not touched.
- fused=True: the base GEMM and the expand in one Triton kernel (the expand is the GEMM's epilogue), kept to be
  timed against (benchmarks/bench_kernels.py). Its base GEMM ran at about half cuBLAS's rate at the Qwen3 q|k|v
  and o shapes on an H200 (benchmarks/results/e2e_notes.md), which is why it is no longer the default.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kernels._triton import resolve_impl, triton
from kernels.fused_moe_lora import (GemmConfig, check_kernel_rank, default_config, device_const, launch_gemm,
                                    launch_shrink, lora_delta)
from kernels.moe_align import moe_align


def _offsets(slice_offsets, n: int) -> tuple[int, ...]:
    offs = (0, n) if slice_offsets is None else tuple(int(o) for o in slice_offsets)
    if offs[0] != 0 or offs[-1] != n or any(b <= a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"slice_offsets must rise strictly from 0 to N={n}, got {offs}")
    return offs


def check_lora_linear_inputs(x, w, bias, lora_a, lora_b, scaling, offs, token_adapter) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x (T, Kin) and w (N, Kin) do not fit: {tuple(x.shape)} vs {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w is {w.dtype} but x is {x.dtype}; cast the weight to the run dtype")
    T, kin = x.shape
    n = w.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be (N={n},), got {tuple(bias.shape)}")
    if lora_a is None and lora_b is None:
        return
    if lora_a is None or lora_b is None or scaling is None or token_adapter is None:
        raise ValueError("LoRA needs all of lora_a (L,S,R,Kin), lora_b (L,N,R), scaling (L,) and token_adapter "
                         "(T,) (slot per row, -1 = none)")
    L, S, R, ka = lora_a.shape
    if ka != kin or S != len(offs) - 1:
        raise ValueError(f"lora_a must be (L, S={len(offs) - 1}, R, Kin={kin}), got {tuple(lora_a.shape)}")
    if lora_b.shape != (L, n, R):
        raise ValueError(f"lora_b must be (L, N, R) = {(L, n, R)}, got {tuple(lora_b.shape)}")
    if scaling.shape != (L,) or scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be ({L},) float32, got {tuple(scaling.shape)} {scaling.dtype}")
    if token_adapter.shape != (T,):
        raise ValueError(f"token_adapter must be (T={T},), got {tuple(token_adapter.shape)}")


def lora_linear_torch(x, w, bias=None, lora_a=None, lora_b=None, scaling=None, slice_offsets=None,
                      token_adapter=None) -> torch.Tensor:
    out = x.float() @ w.float().T
    if bias is not None:
        out += bias.float()
    if lora_a is not None:
        offs = _offsets(slice_offsets, w.shape[0])
        slots = token_adapter.long()
        for a in slots.unique().tolist():
            if a < 0:
                continue
            rows = slots == a
            for s, (lo, hi) in enumerate(zip(offs, offs[1:])):
                out[rows, lo:hi] += lora_delta(x[rows], lora_a[a, s], lora_b[a, lo:hi], scaling[a],
                                               lora_a.shape[2])
    return out.to(x.dtype)


@contextmanager
def ieee_fp32_matmul():
    """fp32 matmuls in IEEE fp32 inside the block, whatever the process chose: torch.set_float32_matmul_precision
    ("high" / "medium") turns on TF32 in cuBLAS and bf16 in oneDNN, which would break parity with the fp32
    reference. The previous settings come back on exit; nothing is written when they are already IEEE."""
    mm = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [m.fp32_precision for m in mm]
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch refuses to read it after a mix of its legacy and new precision APIs
        legacy = None
    if legacy in ("highest", None) and all(p in ("ieee", "none") for p in saved):
        yield
        return
    if legacy is not None:
        torch.set_float32_matmul_precision("highest")  # the legacy flag and both backends, consistently
    else:  # torch will not give the legacy flag back, so only the per-backend flags are set (and restored)
        for m in mm:
            m.fp32_precision = "ieee"
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for m, p in zip(mm, saved):
            m.fp32_precision = p


def base_linear(x, w, bias=None) -> torch.Tensor:
    """x w^T + bias by the vendor GEMM in x's dtype (cuBLAS on CUDA), IEEE for fp32."""
    if x.dtype != torch.float32:
        return F.linear(x, w, bias)
    with ieee_fp32_matmul():
        return F.linear(x, w, bias)


def delta_config(num_tokens: int, n: int, device: torch.device, dtype: torch.dtype) -> GemmConfig:
    """Tiles of the in-place delta pass. It has no K-loop and is bound by reading and writing out, so tiles are
    smaller than the GEMM's (more programs to spread over the SMs, no pipeline); block_m also sets the shrink's
    rows per program and the padding of every adapter's group."""
    cfg = default_config(num_tokens, 1, n, 16, device, dtype)
    if device.type != "cuda":
        return cfg
    return GemmConfig(min(cfg.block_m, 64), min(128, max(32, triton.next_power_of_2(n))), 16, group_m=cfg.group_m,
                      num_warps=4, num_stages=1)


def lora_linear_triton(x, w, bias=None, lora_a=None, lora_b=None, scaling=None, slice_offsets=None,
                       token_adapter=None, config: GemmConfig | None = None, fused: bool = False) -> torch.Tensor:
    """config: tiles of the fused GEMM (fused=True) or of the delta pass (default)."""
    T, kin = x.shape
    n = w.shape[0]
    has_lora = lora_a is not None
    if not fused and not has_lora:
        return base_linear(x, w, bias)
    L = lora_a.shape[0] if has_lora else 0
    cfg = config or (default_config(T, 1, n, kin, x.device, x.dtype) if fused
                     else delta_config(T, n, x.device, x.dtype))
    routing = moe_align(None, token_adapter if has_lora else None, 1, L, cfg.block_m, impl="triton",
                        num_tokens=T, device=x.device)
    lora_kw = {}
    if has_lora:
        R = lora_a.shape[2]
        check_kernel_rank(R)
        ranks = device_const((R,) * L, x.device)
        s = launch_shrink(x, lora_a.unsqueeze(1), scaling, ranks, routing, False)
        lora_kw = dict(lora_s=s, lora_b=lora_b.unsqueeze(1), scaling=scaling, ranks=ranks,
                       slice_offsets=_offsets(slice_offsets, n))
    if fused:
        out = torch.empty(T, n, dtype=x.dtype, device=x.device)
        return launch_gemm(x, w.unsqueeze(0), out, routing, cfg, x_sorted=False, out_sorted=False,
                           bias=bias.unsqueeze(0) if bias is not None else None, **lora_kw)
    return launch_gemm(x, w.unsqueeze(0), base_linear(x, w, bias), routing, cfg, x_sorted=False, out_sorted=False,
                       add_to_out=True, **lora_kw)


def lora_linear(x, w, bias=None, lora_a=None, lora_b=None, scaling=None, slice_offsets=None, token_adapter=None,
                impl: str = "auto", fused: bool = False) -> torch.Tensor:
    """(T, N) = x w^T + bias + per-row LoRA: for row t with slot a = token_adapter[t] >= 0 and each slice s,
    out[t, lo_s:hi_s] += scaling[a] * (x[t] A[a, s]^T) B[a, lo_s:hi_s]^T. Padded rank columns must be zero.
    Triton: base by cuBLAS + in-place LoRA pass, or (fused=True) the single fused kernel; ignored by 'torch'."""
    offs = _offsets(slice_offsets, w.shape[0]) if w.ndim == 2 else None
    check_lora_linear_inputs(x, w, bias, lora_a, lora_b, scaling, offs, token_adapter)
    args = (x, w, bias, lora_a, lora_b, scaling, offs, token_adapter)
    if resolve_impl(impl, x) == "torch":
        return lora_linear_torch(*args)
    return lora_linear_triton(*args, fused=fused)
