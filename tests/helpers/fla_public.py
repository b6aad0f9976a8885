"""fla-core's public chunk_gated_delta_rule on the runtime's packed layout: the reference the runtime's direct call
of fla's internals (engines/triton/gdn._fla) is held to, bit for bit. CUDA only (fla runs there)."""

from __future__ import annotations

import torch


def fla_public_delta_rule(q, k, v, decay, beta, batch) -> torch.Tensor:
    """q/k (T, hk, dk), v (T, h, dv), decay/beta (T, h), the runtime's Batch -> (T, h, dv) in fla's output dtype."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        decay[None].float(),
        beta[None],
        output_final_state=False,
        cu_seqlens=batch.cu_seqlens.long(),
        use_qk_l2norm_in_kernel=True,
    )
    return out[0]
