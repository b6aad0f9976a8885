"""Seeded MoE-LoRA launches and the kernel-vs-reference check shared by the kernel tests (tests/kernels/) and the
bug zoo's kernel-level faults."""

from __future__ import annotations

from functools import partial

import torch

from lpdiff.kernels import MoeInputs, MoeLoraWeights, moe_forward

NOISE = 1e-5  # fp32 interpreter vs torch reference on the bug zoo's shapes is ~1e-7; a fault must be far above this
CUDA = torch.cuda.is_available()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "kernel output has NaN/inf"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_moe(
    T,
    H,
    I,
    E,
    K,
    activation,
    *,
    ranks=(),
    R=None,
    shared_outer=False,
    bias=False,
    dtype=torch.float32,
    device="cpu",
    none_rows=True,
    experts_used=None,
    x_scale=1.0,
    seed=0,
    pad_garbage=False,
) -> MoeInputs:
    """Random inputs (never zeros). ranks: loaded rank per adapter slot, padded to R with zeros or, pad_garbage,
    with garbage that the kernels must ignore (large finite values in A and B); experts_used: route only to these
    experts so that the others receive zero tokens."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    n1 = I if activation == "relu2" else 2 * I
    x = rnd(T, H, scale=x_scale)
    pool = torch.tensor(experts_used if experts_used is not None else list(range(E)))
    scores = rnd(T, len(pool))
    w, idx = scores.softmax(-1).topk(K, dim=-1)
    topk_ids = pool[idx].to(torch.int32)
    p = dict(
        x=x,
        topk_ids=topk_ids,
        topk_weights=w / w.sum(-1, keepdim=True),
        w_gate_up=rnd(E, n1, H, scale=H**-0.5),
        w_down=rnd(E, H, I, scale=I**-0.5),
    )
    if bias:
        p.update(b_gate_up=rnd(E, n1, scale=0.5), b_down=rnd(E, H, scale=0.5))
    lora, ta = None, None
    if ranks:
        L = len(ranks)
        R = R or max(ranks)
        ea = 1 if shared_outer else E
        gu_a = rnd(L, ea, R, H, scale=H**-0.5)
        gu_b = rnd(L, E, n1, R, scale=R**-0.5)
        d_a = rnd(L, E, R, I, scale=I**-0.5)
        d_b = rnd(L, ea, H, R, scale=R**-0.5)
        for a, r in enumerate(ranks):  # padding past the loaded rank: zeros, as the runtime stores it, or garbage
            for t in (gu_a[a, :, r:], d_a[a, :, r:]):  # large: a shrink that reads it is far off
                t.copy_(rnd(*t.shape, scale=1e3) if pad_garbage else torch.zeros(t.shape))
            # B: large too, finite: the expand "loop" masks B at R and relies on S being zero past the rank (the
            # shrink masks A there), so a shrink that leaks past the rank is far off here; NaN would not be ignored
            for t in (gu_b[a, ..., r:], d_b[a, ..., r:]):
                t.copy_(rnd(*t.shape, scale=1e3) if pad_garbage else torch.zeros(t.shape))
        if shared_outer:
            gu_a, d_b = gu_a.expand(L, E, R, H), d_b.expand(L, E, H, R)
        lora = MoeLoraWeights(
            gu_a, gu_b, d_a, d_b, scaling=(rnd(L).abs() + 0.5).float(), ranks=torch.tensor(ranks, dtype=torch.int32)
        )
        ta = torch.randint(-1 if none_rows else 0, L, (T,), generator=g, dtype=torch.int32)
        ta[:L] = torch.arange(L)  # every slot is used at least once
    p.update(lora=lora, token_adapter=ta)
    moved = {k: move(v, torch.float32 if k == "topk_weights" else dtype, device) for k, v in p.items()}
    return MoeInputs(activation=activation, **moved)


def move(v, dtype, device):
    if isinstance(v, MoeLoraWeights):
        return MoeLoraWeights(*(move(getattr(v, f), dtype, device) for f in MoeLoraWeights.__slots__))
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=dtype if v.dtype == torch.float32 and v.ndim > 1 else v.dtype)
    return v


def check_moe(p: MoeInputs, tol, triton_fn=None, **kw):
    """Kernel vs reference on the full output and on the LoRA delta alone (a dropped adapter is a large delta
    error even when the full output barely moves). triton_fn: the Triton path to run instead of moe_forward's
    (moe_forward_triton, which takes tile configs)."""
    triton_fn = triton_fn or partial(moe_forward, impl="triton")
    ref = moe_forward(p, impl="torch")
    out = triton_fn(p, **kw)
    assert out.shape == ref.shape and out.dtype == p.x.dtype
    err = rel_err(out, ref)
    assert err <= tol, f"rel err {err:.3g} > {tol}"
    if p.lora is not None:
        base = p.without_lora()
        d_ref = ref.float() - moe_forward(base, impl="torch").float()
        d_out = out.float() - triton_fn(base, **kw).float()
        derr = rel_err(d_out, d_ref)
        assert derr <= 3 * tol, f"LoRA delta rel err {derr:.3g} > {3 * tol}"
    return out, ref
