"""Qwen3.5's small elementwise steps as one Triton pass each, beside their torch references (which the CPU and
``impl="torch"`` run): the gated attention's output gate, the shared expert's SiLU-and-mul and the Gated DeltaNet's
decay and write strength.

Each rounds as the torch chain it replaces rounds in 16 bits (every torch op computes in fp32 and rounds its result
to the dtype), and compiled for CUDA computes torch's fp32 values too: libdevice's expf / log1pf and IEEE division,
as torch's CUDA kernels (norm.torch_sigmoid). Interpreted (no libdevice) the last fp32 bit of exp / log may differ.
Torch runs them as 2, 2 and 9 launches (the attention output's sigmoid and product; the shared expert's SiLU and
product; the GDN's sigmoid, two casts, exp, neg, add, softplus and product): on the H200 ~44 us per attention layer,
~14 us per MoE block and ~20 us per GDN layer, ~1.4 ms per call of Qwen3.5-35B-A3B at 8 x 512 tokens
(benchmarks/results/hybrid_audit.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lpdiff.engines.triton._jit import INTERPRETED, pow2, tl, triton, use_triton
from lpdiff.engines.triton.norm import torch_sigmoid, torch_silu
from lpdiff.kernels.activation import activate


def sigmoid_gate_torch(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate (T, h, d) -> o * sigmoid(gate) as (T, h * d), as transformers' Qwen3_5MoeAttention."""
    T = o.shape[0]
    return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 S) gate | up -> silu(gate) * up (T, S), as transformers' Qwen3_5MoeMLP: the experts' gated SiLU."""
    return activate(gate_up, "silu")


def gdn_gates_torch(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """a, b (T, h) -> g = -exp(A_log) softplus(a + dt_bias) in fp32 (the log decay) and beta = sigmoid(b) in b's
    dtype, as transformers' Qwen3_5MoeGatedDeltaNet."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _sigmoid_gate_kernel(
        O,
        G,
        Out,
        stride_ot,
        stride_oh,
        stride_gt,
        stride_gh,
        N: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = n < N
        head, j = n // D, n % D
        o = tl.load(O + t * stride_ot + head * stride_oh + j, mask=ok, other=0.0)
        g = tl.load(G + t * stride_gt + head * stride_gh + j, mask=ok, other=0.0).to(tl.float32)
        sg = torch_sigmoid(g, EXACT).to(o.dtype).to(tl.float32)  # torch.sigmoid, rounded to the dtype
        tl.store(Out + t * N + n, (o.to(tl.float32) * sg).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(GU, Out, S, stride_gu, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = n < S
        g = tl.load(GU + t * stride_gu + n, mask=ok, other=0.0)
        u = tl.load(GU + t * stride_gu + S + n, mask=ok, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        sg = torch_silu(gf, EXACT).to(g.dtype).to(tl.float32)  # F.silu, rounded to the dtype
        tl.store(Out + t * S + n, (sg * u).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _gdn_gates_kernel(
        A, B, ALog, DtBias, G, Beta, total, H, stride_a, stride_b, BLOCK: tl.constexpr, EXACT: tl.constexpr
    ):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        row, h = i // H, i % H
        b = tl.load(B + row * stride_b + h, mask=ok, other=0.0)
        bf = b.to(tl.float32)
        tl.store(Beta + i, torch_sigmoid(bf, EXACT).to(Beta.dtype.element_ty), mask=ok)
        x = tl.load(A + row * stride_a + h, mask=ok, other=0.0).to(tl.float32)
        x = x + tl.load(DtBias + h, mask=ok, other=0.0).to(tl.float32)
        a_log = tl.load(ALog + h, mask=ok, other=0.0).to(tl.float32)
        if EXACT:  # torch's softplus (threshold 20) and exp: log1pf(expf(x)), expf
            sp = tl.where(x > 20.0, x, libdevice.log1p(libdevice.exp(tl.minimum(x, 20.0))))
            decay = libdevice.exp(a_log)
        else:  # log1p(u) as log(1 + u) * u / ((1 + u) - 1) (Goldberg), u itself where 1 + u == 1
            u = tl.exp(tl.minimum(x, 20.0))
            w = 1.0 + u
            sp = tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0))))
            decay = tl.exp(a_log)
        tl.store(G + i, -decay * sp, mask=ok)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """o, gate (T, h, d) with unit stride along d (gate may be the gate half of Qwen3.5's query|gate heads) ->
    sigmoid_gate_torch(o, gate) (T, h * d) contiguous, in one pass."""
    if not use_triton(o, impl):
        return sigmoid_gate_torch(o, gate)
    T, h, d = o.shape
    if gate.shape != o.shape or gate.dtype != o.dtype or o.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"sigmoid_gate: o {tuple(o.shape)} {o.dtype} and gate {tuple(gate.shape)} {gate.dtype}")
    out = torch.empty(T, h * d, dtype=o.dtype, device=o.device)
    block = min(1024, pow2(h * d))
    _sigmoid_gate_kernel[(T, triton.cdiv(h * d, block))](
        o,
        gate,
        out,
        o.stride(0),
        o.stride(1),
        gate.stride(0),
        gate.stride(1),
        N=h * d,
        D=d,
        BLOCK=block,
        EXACT=not INTERPRETED,
        num_warps=4,
    )
    return out


def silu_mul(gate_up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """(T, 2 S) with unit column stride -> silu_mul_torch(gate_up) (T, S) contiguous, in one pass."""
    if not use_triton(gate_up, impl):
        return silu_mul_torch(gate_up)
    T, S2 = gate_up.shape
    if S2 % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: gate | up (T, 2 S) with unit column stride, got {tuple(gate_up.shape)}")
    out = torch.empty(T, S2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(S2 // 2))
    _silu_mul_kernel[(T, triton.cdiv(S2 // 2, block))](
        gate_up, out, S2 // 2, gate_up.stride(0), BLOCK=block, EXACT=not INTERPRETED
    )
    return out


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, impl: str = "auto"):
    """a, b (T, h) with unit column stride (column blocks of the in projection), A_log and dt_bias (h,) ->
    gdn_gates_torch's (g (T, h) fp32, beta (T, h) in b's dtype), contiguous, in one launch."""
    if not use_triton(b, impl):
        return gdn_gates_torch(a, b, a_log, dt_bias)
    T, H = b.shape
    if a.shape != b.shape or a.stride(1) != 1 or b.stride(1) != 1 or a_log.shape != (H,) or dt_bias.shape != (H,):
        raise ValueError(f"gdn_gates: a {tuple(a.shape)}, b {tuple(b.shape)} (unit column stride), A_log, dt_bias (h,)")
    g = torch.empty(T, H, dtype=torch.float32, device=b.device)
    beta = torch.empty(T, H, dtype=b.dtype, device=b.device)
    block = 1024
    _gdn_gates_kernel[(triton.cdiv(T * H, block),)](
        a,
        b,
        a_log,
        dt_bias,
        g,
        beta,
        T * H,
        H,
        a.stride(0),
        b.stride(0),
        BLOCK=block,
        EXACT=not INTERPRETED,
        num_warps=4,
    )
    return g, beta
