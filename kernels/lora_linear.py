"""Batched dense LoRA linear (attention, linear-attention, mamba and shared-expert projections): several adapters
per batch, rows with none, outputs split into slices (q|k|v, gate|up) that each have their own A.

Shapes: T tokens, Kin input width, N output width, S slices, R max rank, L adapter slots, M padded rows.

Three paths (``path=``):
- "cublas" (the default): three vendor GEMMs and no Triton launch. Base x w^T (+ bias); shrink S = x A_all^T with
  A_all every slot's and slice's A viewed as one (L*S*R, Kin) matrix; each row keeps only its own slot's columns
  (a (T, L) one-hot, or no mask at all when the caller knows every row uses one slot); expand by one in-place
  out += S B_packed^T, where B_packed (N, L*S*R) is block-diagonal over slices with the slot's scaling folded in
  (pack_lora_b; it depends only on the adapters, so the engine builds it once). The LoRA math is tiny next to the
  base, so what counted was launches: the Triton delta path (alignment, shrink and delta kernels, each launch
  with ~50 arguments costing tens of microseconds of Python) took Qwen3's q|k|v from 6.06 to 13.19 ms and o from
  4.56 to 13.22 ms per forward for a rank-32 delta (H200, benchmarks/results/e2e.md). Every row
  computes all L slots' shrink columns: L*S*R / N extra work on the base, small for the few adapters of a batch.
- "triton_delta": tokens sorted by slot and padded to the block size (moe_align), the shrink kernel of
  lora_shrink.py, then a Triton pass that adds each slice's S B^T to the cuBLAS base output in place.
- "fused" (or fused=True): the base GEMM and the expand in one Triton kernel (the expand is the GEMM's epilogue).
  Its base GEMM ran at about half cuBLAS's rate at the Qwen3 q|k|v and o shapes on an H200
  (benchmarks/results/e2e.md).
The last two are kept to be timed against (benchmarks/bench_kernels.py).

lora_linear_aug is the "cublas" path with the expand folded into the base GEMM as extra K columns, for a caller
that can write x into a wider buffer for free (the engine's q|k|v: its input RMSNorm writes there): out =
[x | S] [w | B_packed]^T, the output written once instead of written and then re-read and re-written by the
expand (29.4 us of Qwen3's q|k|v per layer at 4096 tokens, H200 profile), for 96 extra K of 2048.
lora_linear_shrink_out is the mirror for a layer whose input cannot be widened for free (the engine's o reads the
attention output): the shrink as extra output rows, [out | S] = x [w ; A_all]^T, then the in-place expand.

Precision ("cublas"): bf16/fp16 runs round S = x A^T to the run dtype before the expand (as PEFT's lora_B(lora_A(x))
does) and hold scaling * B rounded once to it; the expand adds onto the base output inside the GEMM (beta = 1; on
cuBLAS one rounding of out). fp32 runs are IEEE fp32 in every GEMM, whatever torch's float32 matmul precision says.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lpdiff.kernels._triton import device_const, resolve_impl, triton
from lpdiff.kernels.gemm_config import GemmConfig, default_config
from lpdiff.kernels.lora_gemm import launch_gemm
from lpdiff.kernels.lora_shrink import check_kernel_rank, launch_shrink
from lpdiff.kernels.lora_weights import lora_delta
from lpdiff.kernels.moe_align import moe_align


def _offsets(slice_offsets, n: int) -> tuple[int, ...]:
    offs = (0, n) if slice_offsets is None else tuple(int(o) for o in slice_offsets)
    if offs[0] != 0 or offs[-1] != n or any(b <= a for a, b in itertools.pairwise(offs)):
        raise ValueError(f"slice_offsets must rise strictly from 0 to N={n}, got {offs}")
    return offs


@dataclass(frozen=True, slots=True)
class LoraLinearInputs:
    """One dense LoRA linear call: what lora_linear builds from its arguments and its torch reference and both
    Triton-side paths take. Building one checks it (one ValueError per bad input, naming the fix) and puts
    slice_offsets in its normal form, a tuple rising from 0 to N."""

    x: torch.Tensor  # (T, Kin)
    w: torch.Tensor  # (N, Kin)
    bias: torch.Tensor | None = None  # (N,)
    lora_a: torch.Tensor | None = None  # (L, S, R, Kin), zero past each slot's loaded rank
    lora_b: torch.Tensor | None = None  # (L, N, R)
    scaling: torch.Tensor | None = None  # (L,) float32
    slice_offsets: tuple[int, ...] | None = None  # S + 1 column offsets of the slices; None: one slice
    token_adapter: torch.Tensor | None = None  # (T,) slot per row, -1 = none

    def __post_init__(self) -> None:
        x, w, bias, lora_a, lora_b, scaling = self.x, self.w, self.bias, self.lora_a, self.lora_b, self.scaling
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"x (T, Kin) and w (N, Kin) do not fit: {tuple(x.shape)} vs {tuple(w.shape)}")
        T, kin = x.shape
        n = w.shape[0]
        offs = _offsets(self.slice_offsets, n)
        object.__setattr__(self, "slice_offsets", offs)  # frozen: set once, here
        if w.dtype != x.dtype:
            raise ValueError(f"w is {w.dtype} but x is {x.dtype}; cast the weight to the run dtype")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be (N={n},), got {tuple(bias.shape)}")
        if lora_a is None and lora_b is None:
            return
        if lora_a is None or lora_b is None or scaling is None or self.token_adapter is None:
            raise ValueError(
                "LoRA needs all of lora_a (L,S,R,Kin), lora_b (L,N,R), scaling (L,) and token_adapter "
                "(T,) (slot per row, -1 = none)"
            )
        L, S, R, ka = lora_a.shape
        if ka != kin or len(offs) - 1 != S:
            raise ValueError(f"lora_a must be (L, S={len(offs) - 1}, R, Kin={kin}), got {tuple(lora_a.shape)}")
        if lora_b.shape != (L, n, R):
            raise ValueError(f"lora_b must be (L, N, R) = {(L, n, R)}, got {tuple(lora_b.shape)}")
        if scaling.shape != (L,) or scaling.dtype != torch.float32:
            raise ValueError(f"scaling must be ({L},) float32, got {tuple(scaling.shape)} {scaling.dtype}")
        if self.token_adapter.shape != (T,):
            raise ValueError(f"token_adapter must be (T={T},), got {tuple(self.token_adapter.shape)}")

    @property
    def offsets(self) -> tuple[int, ...]:
        assert self.slice_offsets is not None  # normalised when built
        return self.slice_offsets


def lora_linear_torch(inp: LoraLinearInputs) -> torch.Tensor:
    x, w, lora_a = inp.x, inp.w, inp.lora_a
    out = x.float() @ w.float().T
    if inp.bias is not None:
        out += inp.bias.float()
    if lora_a is not None and inp.lora_b is not None and inp.scaling is not None and inp.token_adapter is not None:
        slots = inp.token_adapter.long()
        for a in slots.unique().tolist():
            if a < 0:
                continue
            rows = slots == a
            for s, (lo, hi) in enumerate(itertools.pairwise(inp.offsets)):
                delta = lora_delta(x[rows], lora_a[a, s], inp.lora_b[a, lo:hi], inp.scaling[a], lora_a.shape[2])
                out[rows, lo:hi] += delta
    return out.to(x.dtype)


@contextmanager
def ieee_fp32_matmul():
    """fp32 matmuls in IEEE fp32 inside the block, whatever the process chose: torch.set_float32_matmul_precision
    ("high" / "medium") turns on TF32 in cuBLAS and bf16 in oneDNN, which would break parity with the fp32
    reference. The previous settings come back on exit; nothing is written when they are already IEEE."""
    mm = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)  # type: ignore[attr-defined]  # set at import
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


def exact_matmuls(dtype: torch.dtype):
    """The matmul setting of a run in ``dtype``: IEEE for fp32 (see ieee_fp32_matmul), as is for 16-bit types."""
    return ieee_fp32_matmul() if dtype == torch.float32 else nullcontext()


def base_linear(x, w, bias=None) -> torch.Tensor:
    """x w^T + bias by the vendor GEMM in x's dtype (cuBLAS on CUDA), IEEE for fp32."""
    with exact_matmuls(x.dtype):
        return F.linear(x, w, bias)


def pack_lora_b(lora_b, scaling, slice_offsets=None, R: int | None = None) -> torch.Tensor:
    """lora_b (L, N, R) -> B_packed (N, L*S*R) in lora_b's dtype: column l*S*R + s*R + r holds
    scaling[l] * B[l, :, r] on the rows lo_s:hi_s of slice s and zeros elsewhere, so that one GEMM with the shrink
    S = x A_all^T (A_all = lora_a viewed (L*S*R, Kin)) adds every slice's delta to its own output columns only.
    The scaling multiplies in fp32 and rounds once. R, if given, must be lora_b's rank (lora_a.shape[2])."""
    L, n, rank = lora_b.shape
    if R is not None and rank != R:
        raise ValueError(f"lora_b has rank {rank} but R={R}; pass lora_a.shape[2] and the matching lora_b")
    if scaling.shape != (L,):
        raise ValueError(f"scaling must be (L={L},), got {tuple(scaling.shape)}")
    offs = _offsets(slice_offsets, n)
    S = len(offs) - 1
    packed = lora_b.new_zeros(n, L, S, rank)
    scaled = lora_b.float() * scaling.float().to(lora_b.device)[:, None, None]
    for s, (lo, hi) in enumerate(itertools.pairwise(offs)):
        packed[lo:hi, :, s] = scaled[:, lo:hi].transpose(0, 1).to(lora_b.dtype)
    return packed.view(n, L * S * rank)


def slot_one_hot(token_adapter: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """(T,) slot per row (-1 none) -> (T, num_slots) one-hot in ``dtype``; rows of -1 are all zero."""
    return (token_adapter[:, None].long() == torch.arange(num_slots, device=token_adapter.device)).to(dtype)


def check_cublas_extras(x, lora_a, n, b_packed, slot_mask, uniform_slot) -> None:
    L, S, R, _ = lora_a.shape
    if b_packed is not None and (b_packed.shape != (n, L * S * R) or b_packed.dtype != x.dtype):
        raise ValueError(
            f"b_packed must be (N, L*S*R) = {(n, L * S * R)} {x.dtype} (pack_lora_b of lora_b in the "
            f"run dtype), got {tuple(b_packed.shape)} {b_packed.dtype}"
        )
    check_slot_choice(x, L, slot_mask, uniform_slot, required=False)


def check_slot_choice(x, L: int, slot_mask, uniform_slot, required: bool = True) -> None:
    """slot_mask (T, L) in x's dtype and/or a uniform_slot in [0, L); ``required``: exactly one of them."""
    if slot_mask is not None and (slot_mask.shape != (x.shape[0], L) or slot_mask.dtype != x.dtype):
        raise ValueError(
            f"slot_mask must be (T, L) = {(x.shape[0], L)} {x.dtype} (slot_one_hot of token_adapter), "
            f"got {tuple(slot_mask.shape)} {slot_mask.dtype}"
        )
    if uniform_slot is not None and not 0 <= uniform_slot < L:
        raise ValueError(
            f"uniform_slot must be a slot in [0, {L}) used by every row, got {uniform_slot}; pass "
            "None when rows differ or some have no adapter"
        )
    if required and (slot_mask is None) == (uniform_slot is None):
        raise ValueError("pass exactly one of slot_mask (T, L) (slot_one_hot of token_adapter) and uniform_slot")


def lora_linear_cublas(
    inp: LoraLinearInputs, b_packed=None, slot_mask=None, uniform_slot: int | None = None
) -> torch.Tensor:
    """The "cublas" path (module docstring). b_packed: pack_lora_b(lora_b, scaling, slice_offsets), built here
    when None. uniform_slot: the slot of every row, when the caller knows it (then no mask is applied and only that
    slot's columns are computed); else slot_mask (T, L) (slot_one_hot of token_adapter, built here when None)."""
    x, lora_a, token_adapter = inp.x, inp.lora_a, inp.token_adapter
    with exact_matmuls(x.dtype):
        out = F.linear(x, inp.w, inp.bias)
        if lora_a is None:
            return out
        assert token_adapter is not None  # LoraLinearInputs holds all of the LoRA or none of it
        L, S, R, kin = lora_a.shape
        if b_packed is None:
            b_packed = pack_lora_b(inp.lora_b, inp.scaling, inp.offsets)
        if uniform_slot is not None:
            s = F.linear(x, lora_a[uniform_slot].reshape(S * R, kin))
        else:
            s = F.linear(x, lora_a.reshape(L * S * R, kin))
            slot_mask = slot_mask if slot_mask is not None else slot_one_hot(token_adapter, L, x.dtype)
        return add_expand(out, s, b_packed, S * R, slot_mask, uniform_slot)


def add_expand(out: torch.Tensor, s: torch.Tensor, b_packed: torch.Tensor, width: int, slot_mask, uniform_slot):
    """out += S B_packed^T in place (one GEMM with beta = 1). s (T, L*width): every slot's shrink columns, masked
    here per row by slot_mask (T, L); with uniform_slot, s holds only that slot's width columns or all of them
    (the slot's are used)."""
    if uniform_slot is not None:
        lo, hi = uniform_slot * width, (uniform_slot + 1) * width
        return out.addmm_(s if s.shape[1] == width else s[:, lo:hi], b_packed[:, lo:hi].T)
    s.view(s.shape[0], -1, width).mul_(slot_mask[:, :, None])
    return out.addmm_(s, b_packed.T)


def stack_shrink_rows(w: torch.Tensor, lora_a: torch.Tensor, bias: torch.Tensor | None = None):
    """-> (W_s, bias_s): W_s = [w ; A_all] (N + L*S*R, Kin) in one allocation, the weight of
    lora_linear_shrink_out, and its bias [bias ; 0] (None without a bias). Batches without an adapter run the base
    GEMM on the contiguous view W_s[:N], so the layer keeps no second copy of w."""
    L, S, R, kin = lora_a.shape
    if w.ndim != 2 or w.shape[1] != kin:
        raise ValueError(f"w must be (N, Kin={kin}) like lora_a's last dim, got {tuple(w.shape)}")
    w_s = torch.cat([w, lora_a.reshape(L * S * R, kin).to(w.dtype)], dim=0)
    bias_s = None if bias is None else torch.cat([bias, bias.new_zeros(L * S * R)])
    return w_s, bias_s


def lora_linear_shrink_out(
    x, w_s, bias_s, n: int, b_packed, width: int, slot_mask=None, uniform_slot: int | None = None
) -> torch.Tensor:
    """The "cublas" path with the shrink folded into the base GEMM as extra output columns: [out | S] =
    x [w ; A_all]^T (+ [bias ; 0]), then out += S B_packed^T in place. For a layer whose input cannot be widened
    for free (the engine's o projection reads the attention output), this drops the separate shrink GEMM (Qwen3's
    o at 4096 tokens: a split-K GEMM and its reduction, ~13 us per layer on an H200) for L*S*R extra
    columns of N (32 of 2048 per slot at rank 32).
    w_s, bias_s: stack_shrink_rows(w, lora_a, bias); n: the base width N; b_packed (N, L*S*R); width: S*R, the
    columns of one slot; slot_mask (T, L) or uniform_slot, as lora_linear_aug. -> (T, N), a view with row stride
    N + L*S*R of the GEMM's output.
    Precision as the "cublas" path: S rounded to the run dtype (every slot's columns are computed; a row keeps its
    own), the expand accumulated onto the base output with one rounding; fp32 runs are IEEE fp32."""
    if x.ndim != 2 or w_s.ndim != 2 or w_s.shape[1] != x.shape[1] or w_s.dtype != x.dtype:
        raise ValueError(
            f"w_s must be (N + L*S*R, Kin={x.shape[-1]}) {x.dtype} (stack_shrink_rows), got "
            f"{tuple(w_s.shape)} {w_s.dtype}"
        )
    if b_packed.ndim != 2 or b_packed.shape != (n, w_s.shape[0] - n):
        raise ValueError(
            f"b_packed must be (N, L*S*R) = {(n, w_s.shape[0] - n)} (pack_lora_b), got {tuple(b_packed.shape)}"
        )
    L = (w_s.shape[0] - n) // width
    if L * width != w_s.shape[0] - n:
        raise ValueError(f"w_s has {w_s.shape[0] - n} shrink rows, not a multiple of the slot width {width}")
    check_slot_choice(x, L, slot_mask, uniform_slot)
    with exact_matmuls(x.dtype):
        y = F.linear(x, w_s, bias_s)
        out, s = y[:, :n], y[:, n:]
        return add_expand(out, s, b_packed, width, slot_mask, uniform_slot)


def augment_weight(w: torch.Tensor, b_packed: torch.Tensor) -> torch.Tensor:
    """W_aug = [w | b_packed] (N, Kin + L*S*R), one allocation: the weight of lora_linear_aug. Batches without an
    adapter run the base GEMM on the view W_aug[:, :Kin] (a strided operand cuBLAS reads through its leading
    dimension, no copy), so the layer keeps no second copy of w."""
    if w.ndim != 2 or b_packed.ndim != 2 or b_packed.shape[0] != w.shape[0] or b_packed.dtype != w.dtype:
        raise ValueError(
            f"b_packed must be (N={w.shape[0]}, L*S*R) {w.dtype} (pack_lora_b in the run dtype), got "
            f"{tuple(b_packed.shape)} {b_packed.dtype}"
        )
    return torch.cat([w, b_packed], dim=1)


def check_aug_inputs(xa, w_aug, bias, lora_a, slot_mask, uniform_slot) -> None:
    L, S, R, kin = lora_a.shape
    width = kin + L * S * R
    if xa.ndim != 2 or xa.shape[1] != width or xa.stride(1) != 1:
        raise ValueError(
            f"xa must be (T, Kin + L*S*R) = (T, {width}) with unit column stride (x in its first Kin "
            f"columns), got {tuple(xa.shape)} strides {xa.stride()}"
        )
    if w_aug.ndim != 2 or w_aug.shape[1] != width or w_aug.dtype != xa.dtype:
        raise ValueError(
            f"w_aug must be (N, {width}) {xa.dtype} (augment_weight(w, pack_lora_b(...))), got "
            f"{tuple(w_aug.shape)} {w_aug.dtype}"
        )
    if bias is not None and bias.shape != (w_aug.shape[0],):
        raise ValueError(f"bias must be (N={w_aug.shape[0]},), got {tuple(bias.shape)}")
    check_slot_choice(xa, L, slot_mask, uniform_slot)


def lora_linear_aug(
    xa, w_aug, bias, lora_a, slot_mask=None, uniform_slot: int | None = None, others_zero: bool = False
) -> torch.Tensor:
    """The "cublas" path with the expand folded into the base GEMM as extra K columns, so the output is written
    once (no in-place expand re-reading and re-writing it): out = [x | s] [w | B_packed]^T + bias.

    xa (T, Kin + L*S*R): x in its first Kin columns, put there by the caller (the engine's input RMSNorm writes
    straight into them); the shrink s = x A_all^T goes into the other columns here (a GEMM into a strided column
    block: cuBLAS writes it through its leading dimension, no copy), masked per row by slot_mask (T, L).
    w_aug = augment_weight(w, pack_lora_b(lora_b, scaling, slice_offsets)). uniform_slot (every row uses it):
    only that slot's S*R shrink columns are computed and the other slots' columns must be zero; they are zeroed
    here unless ``others_zero`` says the caller's buffer already holds zeros there (a buffer zeroed once and shared
    by every layer). The other slots then cost (L-1)*S*R zero columns of extra K (Qwen3's q|k|v: 96 of 2048 per
    slot at rank 32), cheaper than the separate expand this replaces; a GEMM over one slot's columns alone would
    need [w | B_slot] contiguous, a copy of w per slot.
    Precision: s is rounded to the run dtype before the expand (as PEFT's lora_B(lora_A(x)) is); base and delta
    accumulate in one GEMM and round once. fp32 runs are IEEE fp32 in both GEMMs."""
    check_aug_inputs(xa, w_aug, bias, lora_a, slot_mask, uniform_slot)
    L, S, R, kin = lora_a.shape
    T, width = xa.shape[0], S * R
    x, s = xa[:, :kin], xa[:, kin:]
    lo, hi = (0, L * width) if uniform_slot is None else (uniform_slot * width, (uniform_slot + 1) * width)
    if not xa.is_cuda:
        # The shrink columns hold whatever the caller's buffer held (NaN in a reused block). cuBLAS never reads C
        # at beta = 0, but a CPU bf16 GEMM into a strided column block can scale C by beta = 0 instead, and
        # 0 x NaN stays NaN (seen on a CI-class CPU, issue 40). Zeroing first, a T x L*S*R memset on CPU only,
        # makes the result independent of the BLAS and of the allocator.
        s[:, lo:hi].zero_()
    with exact_matmuls(xa.dtype):
        if uniform_slot is None:
            torch.mm(x, lora_a.reshape(L * width, kin).T, out=s)
            s.view(T, L, width).mul_(slot_mask[:, :, None])
        else:
            torch.mm(x, lora_a[uniform_slot].reshape(width, kin).T, out=s[:, lo:hi])
            if not others_zero:
                s[:, :lo].zero_()
                s[:, hi:].zero_()
        return F.linear(xa, w_aug, bias)


def delta_config(num_tokens: int, n: int, device: torch.device, dtype: torch.dtype) -> GemmConfig:
    """Tiles of the in-place delta pass. It has no K-loop and is bound by reading and writing out, so tiles are
    smaller than the GEMM's (more programs to spread over the SMs, no pipeline); block_m also sets the shrink's
    rows per program and the padding of every adapter's group."""
    cfg = default_config(num_tokens, 1, n, 16, device, dtype)
    if device.type != "cuda":
        return cfg
    return GemmConfig(
        min(cfg.block_m, 64),
        min(128, max(32, triton.next_power_of_2(n))),
        16,
        group_m=cfg.group_m,
        num_warps=4,
        num_stages=1,
    )


PATHS = ("cublas", "triton_delta", "fused")


def lora_linear_triton(inp: LoraLinearInputs, fused: bool, config: GemmConfig | None = None) -> torch.Tensor:
    """The Triton paths (module docstring): "fused", else "triton_delta". config: tiles of the fused GEMM or of
    the delta pass."""
    x, w, bias, lora_a, lora_b, scaling = inp.x, inp.w, inp.bias, inp.lora_a, inp.lora_b, inp.scaling
    T, kin = x.shape
    n = w.shape[0]
    has_lora = lora_a is not None
    if not fused and not has_lora:
        return base_linear(x, w, bias)
    L = lora_a.shape[0] if lora_a is not None else 0
    # fused: the prefetched B tile (one slice) stays in shared memory through the K-loop, off the stage budget
    held = lora_a.shape[2] if fused and lora_a is not None and len(inp.offsets) == 2 else 0
    cfg = config or (
        default_config(T, 1, n, kin, x.device, x.dtype, held_rank=held)
        if fused
        else delta_config(T, n, x.device, x.dtype)
    )
    routing = moe_align(
        None, inp.token_adapter if has_lora else None, 1, L, cfg.block_m, impl="triton", num_tokens=T, device=x.device
    )
    lora_kw: dict[str, Any] = {}
    if lora_a is not None:
        assert lora_b is not None  # LoraLinearInputs holds all of the LoRA or none of it
        R = lora_a.shape[2]
        check_kernel_rank(R)
        ranks = device_const((R,) * L, x.device)
        # the fused GEMM's expand may load S through x's pointers (GemmConfig.expand "loop"): S in x's dtype
        s = launch_shrink(x, lora_a.unsqueeze(1), scaling, ranks, routing, False, dtype=x.dtype if fused else None)
        lora_kw = dict(lora_s=s, lora_b=lora_b.unsqueeze(1), scaling=scaling, ranks=ranks, slice_offsets=inp.offsets)
    if fused:
        out = torch.empty(T, n, dtype=x.dtype, device=x.device)
        return launch_gemm(
            x,
            w.unsqueeze(0),
            out,
            routing,
            cfg,
            x_sorted=False,
            out_sorted=False,
            bias=bias.unsqueeze(0) if bias is not None else None,
            **lora_kw,
        )
    return launch_gemm(
        x,
        w.unsqueeze(0),
        base_linear(x, w, bias),
        routing,
        cfg,
        x_sorted=False,
        out_sorted=False,
        add_to_out=True,
        **lora_kw,
    )


def lora_linear(
    x,
    w,
    bias=None,
    lora_a=None,
    lora_b=None,
    scaling=None,
    slice_offsets=None,
    token_adapter=None,
    impl: str = "auto",
    fused: bool = False,
    path: str = "cublas",
    b_packed=None,
    slot_mask=None,
    uniform_slot: int | None = None,
) -> torch.Tensor:
    """(T, N) = x w^T + bias + per-row LoRA: for row t with slot a = token_adapter[t] >= 0 and each slice s,
    out[t, lo_s:hi_s] += scaling[a] * (x[t] A[a, s]^T) B[a, lo_s:hi_s]^T. Padded rank columns must be zero.
    Triton impl: path "cublas" (default; three vendor GEMMs, b_packed / slot_mask / uniform_slot let a caller pass
    what it precomputed), "triton_delta" or "fused" (= fused=True); see the module docstring. impl 'torch' runs
    the reference and ignores path and the precomputed pieces. uniform_slot is trusted: every row must use it."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if fused and path not in ("cublas", "fused"):
        raise ValueError(f"fused=True is path='fused'; it cannot be combined with path={path!r}")
    inp = LoraLinearInputs(x, w, bias, lora_a, lora_b, scaling, slice_offsets, token_adapter)
    if lora_a is not None:
        check_cublas_extras(x, lora_a, w.shape[0], b_packed, slot_mask, uniform_slot)
    if resolve_impl(impl, x) == "torch":
        return lora_linear_torch(inp)
    if fused or path == "fused":
        return lora_linear_triton(inp, fused=True)
    if path == "triton_delta":
        return lora_linear_triton(inp, fused=False)
    return lora_linear_cublas(inp, b_packed, slot_mask, uniform_slot)
