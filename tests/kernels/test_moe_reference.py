"""kernels/moe_reference.py (the MoE op's torch reference every kernel is held to) against a per-token loop
written here from the op's definition: each token's top-k experts, the expert MLP with its slot's LoRA on gate_up
and down (scaling * B A, only the loaded rank), the routing weight, rows without adapter getting no delta."""

import random

import pytest
import torch

from lpdiff.kernels.activation import activate
from lpdiff.kernels.moe_reference import moe_forward_torch
from tests.helpers.moe import make_moe


def _per_token(p):
    x, ids, w = p.x, p.topk_ids, p.topk_weights
    lora, slots = p.lora, p.token_adapter
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            xt = x[t].double()
            h = p.w_gate_up[e].double() @ xt
            if p.b_gate_up is not None:
                h = h + p.b_gate_up[e].double()
            s = int(slots[t]) if slots is not None else -1
            if s >= 0:
                r = int(lora.ranks[s])
                h = h + float(lora.scaling[s]) * lora.gate_up_b[s, e, :, :r].double() @ (
                    lora.gate_up_a[s, e, :r].double() @ xt
                )
            act = activate(h[None], p.activation)[0]
            y = p.w_down[e].double() @ act
            if p.b_down is not None:
                y = y + p.b_down[e].double()
            if s >= 0:
                y = y + float(lora.scaling[s]) * lora.down_b[s, e, :, :r].double() @ (
                    lora.down_a[s, e, :r].double() @ act
                )
            out[t] += float(w[t, k]) * y
    return out


@pytest.mark.parametrize(
    "activation,kw",
    [
        ("silu", dict(ranks=(4, 2))),
        ("swiglu_oai", dict(ranks=(3,), bias=True)),
        ("relu2", dict(ranks=(4, 1, 2), shared_outer=True)),
        ("silu", dict()),  # no adapter at all
    ],
)
def test_reference_equals_the_per_token_definition(activation, kw):
    p = make_moe(T=11, H=12, I=6, E=5, K=2, activation=activation, seed=random.randrange(2**31), **kw)
    got = moe_forward_torch(p)
    assert got.dtype == torch.float32 and got.shape == p.x.shape
    torch.testing.assert_close(got.double(), _per_token(p), rtol=1e-5, atol=1e-5)
    if p.lora is not None:  # the adapters matter: without them the output moves
        base = moe_forward_torch(p.without_lora())
        assert (got - base).abs().max() > 1e-3
