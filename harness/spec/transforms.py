"""Exact adapter transformations: each returns an adapter that must give the same logprobs as the original
(canonical form: W' = W + scaling * B @ A), or a known change of them (zero B, negated B, rounding-sized moves).
Metamorphic relations serve them to an engine and compare it with itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from lpdiff.harness.spec.adapters import CanonicalAdapter, ModelLayout, peft_scaling
from lpdiff.harness.spec.errors import InputError


def _with(ad: CanonicalAdapter, fn, alpha: float | None = None) -> CanonicalAdapter:
    """A copy with every entry replaced by fn(name, A, B) -> (A, B) (experts: (E, r, in) / (E, out, r))."""
    alpha = ad.alpha if alpha is None else alpha
    return CanonicalAdapter(
        ad.rank,
        alpha,
        ad.use_rslora,
        peft_scaling(alpha, ad.rank, ad.use_rslora),
        {n: fn(n, a, b) for n, (a, b) in ad.dense.items()},
        {n: fn(n, a, b) for n, (a, b) in ad.experts.items()},
        dict(ad.config),
        ad.layout,
    )


def pad_rank(ad: CanonicalAdapter, rank: int) -> CanonicalAdapter:
    """Zero rows of A and zero columns of B up to ``rank`` (save_canonical then scales alpha to keep scaling)."""

    def fn(name, a, b):
        extra = rank - a.shape[-2]
        return (
            torch.cat([a, a.new_zeros(*a.shape[:-2], extra, a.shape[-1])], -2),
            torch.cat([b, b.new_zeros(*b.shape[:-1], extra)], -1),
        )

    return _with(ad, fn)


def reparametrise(ad: CanonicalAdapter, seed: int = 0, spread: float = 2.0) -> CanonicalAdapter:
    """A -> M·A, B -> B·M⁻¹ with M = Q·diag(s) per entry (per expert), Q orthogonal, s in [1/spread, spread]:
    B·A is unchanged up to fp32 rounding (condition number <= spread²)."""
    g = torch.Generator().manual_seed(seed)

    def fn(name, a, b):
        r = a.shape[-2]
        lead = a.shape[:-2]
        q, _ = torch.linalg.qr(torch.randn(*lead, r, r, generator=g, dtype=torch.float64))
        s = spread ** (2 * torch.rand(*lead, 1, r, generator=g, dtype=torch.float64) - 1)
        m = q * s
        return ((m @ a.double()).to(a.dtype), (b.double() @ torch.linalg.inv(m)).to(b.dtype))

    return _with(ad, fn)


def rescale_alpha(ad: CanonicalAdapter, factor: float = 4.0) -> CanonicalAdapter:
    """alpha x factor, B / factor: the same delta (exactly for a power-of-two factor)."""
    return _with(ad, lambda n, a, b: (a, b / factor), alpha=ad.alpha * factor)


def zero_b(ad: CanonicalAdapter) -> CanonicalAdapter:
    return _with(ad, lambda n, a, b: (a, torch.zeros_like(b)))


def negate_b(ad: CanonicalAdapter) -> CanonicalAdapter:
    return _with(ad, lambda n, a, b: (a, -b))


def rerounded(ad: CanonicalAdapter, rel: float, seed: int = 0) -> CanonicalAdapter:
    """Every A and B entry times (1 + rel·u), u uniform in [-1, 1): NOT the same delta, but one that differs from
    it by what one rounding to a dtype of unit roundoff ``rel`` does; the engine's answer to it is the floor for
    relations whose arithmetic differs at that level."""
    g = torch.Generator().manual_seed(seed)

    def jitter(t):
        return t * (1 + rel * (2 * torch.rand(t.shape, generator=g, dtype=torch.float64) - 1)).to(t.dtype)

    return _with(ad, lambda n, a, b: (jitter(a), jitter(b)))


def shared_outer(ad: CanonicalAdapter, layout: ModelLayout) -> CanonicalAdapter:
    """The shared-outer form at rank E·r, exact for any adapter: the input-side projection (gate_up / up) gets one
    A for all experts (every expert's A stacked) and a block-diagonal B; down_proj gets one B for all experts and
    a block-structured A. Dense entries are zero-padded to the new rank when written."""

    def fn(name, a, b):
        if name not in ad.experts:
            return a, b
        E, r = a.shape[0], a.shape[1]
        eye = torch.eye(E, dtype=a.dtype)
        if layout.experts[name].name == "down_proj":  # shared B: (E, out, E*r); A_e is zero outside block e
            b_shared = b.permute(1, 0, 2).reshape(b.shape[1], E * r)
            a_big = (eye[:, :, None, None] * a[:, None]).reshape(E, E * r, a.shape[-1])
            return a_big, b_shared.expand(E, -1, -1).clone()
        a_shared = a.reshape(E * r, a.shape[-1])
        b_big = (eye[:, None, :, None] * b[:, :, None]).reshape(E, b.shape[1], E * r)
        return a_shared.expand(E, -1, -1).clone(), b_big

    return _with(ad, fn)


def split_gate_up(ad: CanonicalAdapter, layout: ModelLayout, seed: int = 0) -> CanonicalAdapter | None:
    """An adapter whose gate and up projections have different A matrices, as one canonical entry of inner dim 2r
    (A = [A_gate; A_up], B_gate = [B_gate, 0], B_up = [0, B_up]). None when no expert entry has gate and up."""
    g = torch.Generator().manual_seed(seed)
    gated = [n for n in ad.experts if len(layout.experts[n].parts) == 2]
    if not gated:
        return None

    def fn(name, a, b):
        if name not in gated:
            return a, b
        p = layout.experts[name]
        gate, up = p.part_rows()
        a_up = torch.randn(a.shape, generator=g, dtype=torch.float32).to(a.dtype) / math.sqrt(a.shape[-1])
        b2 = b.new_zeros(b.shape[0], b.shape[1], 2 * b.shape[2])
        r = b.shape[2]
        b2[:, gate, :r], b2[:, up, r:] = b[:, gate], b[:, up]
        return torch.cat([a, a_up], 1), b2

    return _with(ad, fn)


def strip_zero_rank(src: str | Path, dst: str | Path) -> Path:
    """Copy an adapter directory keeping, per module, only the rank components whose A row and B column are both
    non-zero (the per-projection form of a block-structured stacked adapter). Every module must keep the same
    number; alpha is rescaled so the scaling is unchanged."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    out, kept = {}, set()
    for key in tensors:
        if not key.endswith("lora_A.weight"):
            continue
        bkey = key[: -len("lora_A.weight")] + "lora_B.weight"
        a, b = tensors[key], tensors[bkey]
        keep = (a.abs().sum(1) > 0) & (b.abs().sum(0) > 0)
        kept.add(int(keep.sum()))
        out[key], out[bkey] = a[keep].contiguous(), b[:, keep].contiguous()
    if len(kept) != 1:
        raise InputError(
            f"{src}: modules keep different numbers of non-zero rank components {sorted(kept)}; one "
            "rank per adapter file cannot hold them"
        )
    (new,) = kept
    old_scaling = peft_scaling(cfg["lora_alpha"], cfg["r"], cfg.get("use_rslora", False))
    alpha = cfg["lora_alpha"] * (math.sqrt(new / cfg["r"]) if cfg.get("use_rslora") else new / cfg["r"])
    if peft_scaling(alpha, new, cfg.get("use_rslora", False)) != old_scaling:
        raise InputError(f"{src}: no lora_alpha keeps the scaling exactly at rank {new}")
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg.update(r=new, lora_alpha=alpha)
    (dst / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst
