# Copyright (c) 2024, Tri Dao.
# Based on the Triton LayerNorm tutorial: https://triton-lang.org/main/getting-started/tutorials/05-layer-norm.html
# For the backward pass, we keep weight_grad and bias_grad in registers and accumulate.
# This backward pass is faster for dimensions up to 8k, but after that it's much slower due to register spilling.
# The models we train have hidden dim up to 8k anyway (e.g. Llama 70B), so this is fine.

import math

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

try:  # lpdiff: einops serves only rms_norm_ref, which lpdiff does not call
    from einops import rearrange
except ImportError:
    rearrange = None


def rms_norm_ref(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, upcast=True):
    dtype = x.dtype
    N = x.shape[-1]
    weight = weight.float()
    bias = bias.float() if bias is not None else None
    if upcast:
        x = x.float()
        z = z.float() if z is not None else z
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    if group_size is None:
        rstd = 1 / torch.sqrt((x.square()).mean(dim=-1, keepdim=True) + eps)
        out = (x * rstd * weight) + bias if bias is not None else (x * rstd * weight)
    else:
        x_group = rearrange(x, "... (g d) -> ... g d", d=group_size)
        rstd = 1 / torch.sqrt((x_group.square()).mean(dim=-1, keepdim=True) + eps)
        out = rearrange(x_group * rstd, "... g d -> ... (g d)") * weight
        if bias is not None:
            out = out + bias
    if z is not None and norm_before_gate:
        out *= F.silu(z)
    return out.to(dtype)


@triton.heuristics({"HAS_BIAS": lambda args: args["B"] is not None})
@triton.heuristics({"HAS_Z": lambda args: args["Z"] is not None})
@triton.jit
def _layer_norm_fwd_1pass_kernel(
    X,  # pointer to the input
    Y,  # pointer to the output
    W,  # pointer to the weights
    B,  # pointer to the biases
    Z,  # pointer to the other branch
    Mean,  # pointer to the mean
    Rstd,  # pointer to the 1/std
    stride_x_row,  # how much to increase the pointer when moving by 1 row
    stride_y_row,
    stride_z_row,
    M,  # number of rows in X
    N,  # number of columns in X
    eps,  # epsilon to avoid division by zero
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    ROUND_NORMED: tl.constexpr = False,  # lpdiff: see README.md
    ROUND_PRODUCT: tl.constexpr = False,  # lpdiff: see README.md
    ROWS: tl.constexpr = 1,  # lpdiff: rows per program, see README.md
):
    # Map the program id to the rows of X and Y it should compute.  # lpdiff: ROWS rows (a 2-D block) per program
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    row_ok = rows < M
    X += rows[:, None] * stride_x_row + group * N
    Y += rows[:, None] * stride_y_row + group * N
    if HAS_Z:
        Z += rows[:, None] * stride_z_row + group * N
    if not IS_RMS_NORM:
        Mean += group * M
    Rstd += group * M
    W += group * N
    if HAS_BIAS:
        B += group * N
    # Compute mean and variance
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < N)
    x = tl.load(X + cols[None, :], mask=mask, other=0.).to(tl.float32)
    if HAS_Z and not NORM_BEFORE_GATE:
        z = tl.load(Z + cols[None, :], mask=mask).to(tl.float32)
        x *= z * tl.sigmoid(z)
    if not IS_RMS_NORM:
        mean = tl.sum(x, axis=1) / N
        tl.store(Mean + rows, mean, mask=row_ok)
        xbar = tl.where(mask, x - mean[:, None], 0.)
        var = tl.sum(xbar * xbar, axis=1) / N
    else:
        xbar = tl.where(mask, x, 0.)
        var = tl.sum(xbar * xbar, axis=1) / N
    rstd = 1 / tl.sqrt(var + eps)
    tl.store(Rstd + rows, rstd, mask=row_ok)
    # Normalize and apply linear transformation
    wmask = cols < N
    w = tl.load(W + cols, mask=wmask).to(tl.float32)[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=wmask).to(tl.float32)[None, :]
    x_hat = (x - mean[:, None]) * rstd[:, None] if not IS_RMS_NORM else x * rstd[:, None]
    if ROUND_NORMED:  # lpdiff: transformers' .to(input_dtype) before the weight
        x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
    y = x_hat * w + b if HAS_BIAS else x_hat * w
    if ROUND_PRODUCT:  # lpdiff: the weight product in the output's dtype before the gate (Qwen3.5)
        y = y.to(Y.dtype.element_ty).to(tl.float32)
    if HAS_Z and NORM_BEFORE_GATE:
        z = tl.load(Z + cols[None, :], mask=mask).to(tl.float32)
        y *= z * tl.sigmoid(z)
    # Write output
    tl.store(Y + cols[None, :], y, mask=mask)


def _layer_norm_fwd(x, weight, bias, eps, z=None, out=None, group_size=None, norm_before_gate=True, is_rms_norm=False,
                    round_normed=False, round_product=False):  # lpdiff: round_normed, round_product
    M, N = x.shape
    if group_size is None:
        group_size = N
    assert N % group_size == 0
    ngroups = N // group_size
    assert x.stride(-1) == 1
    if z is not None:
        assert z.stride(-1) == 1
        assert z.shape == (M, N)
    assert weight.shape == (N,)
    assert weight.stride(-1) == 1
    if bias is not None:
        assert bias.stride(-1) == 1
        assert bias.shape == (N,)
    # allocate output
    if out is not None:
        assert out.shape == x.shape
    else:
        out = torch.empty_like(x)
    assert out.stride(-1) == 1
    mean = torch.empty((ngroups * M, ), dtype=torch.float32, device=x.device) if not is_rms_norm else None
    rstd = torch.empty((ngroups * M, ), dtype=torch.float32, device=x.device)
    # Less than 64KB per feature: enqueue fused kernel
    MAX_FUSED_SIZE = 65536 // x.element_size()
    BLOCK_N = min(MAX_FUSED_SIZE, triton.next_power_of_2(group_size))
    if group_size > BLOCK_N:
        raise RuntimeError("This layer norm doesn't support feature dim >= 64KB.")
    # heuristics for number of warps
    num_warps = min(max(BLOCK_N // 256, 1), 8)
    # lpdiff: groups under 512 columns take several rows per program, up to 2048 elements (one warp's upstream
    # program per 128-column row ran 4096 x 32 of them for Qwen3.5's 32 heads: 80 us where the bytes take ~25)
    rows = 1 if BLOCK_N >= 512 else 2048 // BLOCK_N
    if rows > 1:
        num_warps = 4
    grid = (triton.cdiv(M, rows), ngroups)
    with torch.cuda.device(x.device.index):
        _layer_norm_fwd_1pass_kernel[grid](x, out, weight, bias, z, mean, rstd,
                                           x.stride(0), out.stride(0), z.stride(0) if z is not None else 0,
                                           M, group_size, eps,
                                           BLOCK_N=BLOCK_N,
                                           NORM_BEFORE_GATE=norm_before_gate,
                                           IS_RMS_NORM=is_rms_norm,
                                           ROUND_NORMED=round_normed,
                                           ROUND_PRODUCT=round_product,
                                           ROWS=rows,
                                           num_warps=num_warps)
    return out, mean, rstd
