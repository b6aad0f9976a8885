"""Seeded inputs of the fused LoRA linear (kernels/lora_linear.py), shared by its kernel tests and the triton
engine's uninitialised-buffer test."""

import torch


def make_linear(
    T, kin, widths, L, R, *, bias=True, none_rows=True, ranks=None, dtype=torch.float32, device="cpu", seed=0
):
    """Random inputs; widths are the output slices (q|k|v style); each slot gets its own A per slice. ranks: each
    slot's true rank, zero-padded to R as the runtime stacks adapters of different ranks."""
    g = torch.Generator().manual_seed(seed)
    n = sum(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    p = dict(
        x=torch.randn(T, kin, generator=g),
        w=torch.randn(n, kin, generator=g) * kin**-0.5,
        bias=torch.randn(n, generator=g) if bias else None,
        slice_offsets=offs,
    )
    if L:
        ta = torch.randint(-1 if none_rows else 0, L, (T,), generator=g, dtype=torch.int32)
        ta[:L] = torch.arange(L)
        p.update(
            lora_a=torch.randn(L, len(widths), R, kin, generator=g) * kin**-0.5,
            lora_b=torch.randn(L, n, R, generator=g) * R**-0.5,
            scaling=torch.rand(L, generator=g) + 0.5,
            token_adapter=ta,
        )
        for a, r in enumerate(ranks or ()):
            p["lora_a"][a, :, r:] = 0
            p["lora_b"][a, :, r:] = 0
    return {
        k: (
            v.to(device=device, dtype=dtype if v.is_floating_point() and k != "scaling" else v.dtype)
            if isinstance(v, torch.Tensor)
            else v
        )
        for k, v in p.items()
    }
