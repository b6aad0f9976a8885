"""kernels/moe_reference.py on CPU: a token's output is bit-equal whatever the other tokens of the batch route to.
The base rows keep their routing and slot -1; the adapter rows move from the base rows' experts to others, so those
experts' token counts fall from about 7 to 1-3 (the counts at which MKL's sgemm computes a row differently at any
thread count). The triton runtime's LoRA neutrality rests on it (tests/engines/triton/test_base_rows_neutral.py)."""

import dataclasses
import random

import pytest
import torch

from lpdiff.kernels.moe_reference import moe_forward_torch
from tests.helpers.moe import make_moe

BASE = 3  # base rows; the other rows carry adapter slots


@pytest.mark.parametrize(
    "activation,kw",
    [("silu", dict(ranks=(4, 2))), ("relu2", dict(ranks=(3,))), ("swiglu_oai", dict(ranks=(2, 5), bias=True))],
)
def test_base_rows_do_not_depend_on_the_other_rows_routing(activation, kw):
    seed = random.randrange(2**31)
    p = make_moe(T=15, H=40, I=24, E=6, K=2, activation=activation, seed=seed, **kw)
    T = p.x.shape[0]
    slots = torch.arange(T, dtype=torch.int32) % p.lora.num_slots
    slots[:BASE] = -1
    ids = torch.tensor([[t % 4, (t + 1) % 4] for t in range(T)], dtype=p.topk_ids.dtype)  # 7-8 tokens per expert
    shared = dataclasses.replace(p, topk_ids=ids, token_adapter=slots)
    ids = ids.clone()
    ids[BASE:] = torch.tensor([4, 5], dtype=ids.dtype)
    apart = dataclasses.replace(shared, topk_ids=ids)  # the adapter rows on experts 4 and 5 only: 1-2 tokens each
    a, b = moe_forward_torch(shared), moe_forward_torch(apart)
    d = (a[:BASE] - b[:BASE]).abs().max().item()
    assert torch.equal(a[:BASE], b[:BASE]), f"seed {seed}: base rows moved by {d:.2e}"
    assert (a[BASE:] - b[BASE:]).abs().max() > 1e-3  # the adapter rows did move
