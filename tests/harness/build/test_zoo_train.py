"""The zoo's training pieces (zoo_train.py) on the tiny configs' seeded init (zoo_configs.py): the learning-rate
schedule, scale-free router scores, the router loss terms on constructed logits whose values are known (uniform
usage: balance exactly 1; one expert for every token: E; a wide top-k gap: no margin loss), the hooks that read the
routers, and Nemotron's aux-loss-free bias step. No training run: a rebuild is python -m ... zoo build."""

import math
import random
from itertools import pairwise

import pytest
import torch

from lpdiff.harness.build.zoo_configs import init_model, tiny_config
from lpdiff.harness.build.zoo_train import (
    RouterTap,
    TrainConfig,
    lr_at,
    router_losses,
    standardized,
    update_correction_bias,
)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    tc = TrainConfig(steps=200, warmup=20, lr=1e-3)
    lrs = [lr_at(s, tc) for s in range(tc.steps)]
    assert lrs[0] == pytest.approx(tc.lr / tc.warmup) and lrs[tc.warmup - 1] == pytest.approx(tc.lr)
    assert all(a < b for a, b in pairwise(lrs[: tc.warmup]))
    assert all(a >= b for a, b in pairwise(lrs[tc.warmup :]))
    assert lr_at(tc.steps, tc) == pytest.approx(0.1 * tc.lr)


def test_standardized_scores_do_not_see_the_routers_scale():
    s = torch.randn(7, 8, dtype=torch.float64)
    u = standardized(s)
    torch.testing.assert_close(u.mean(-1), torch.zeros(7, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(u.std(-1), torch.ones(7, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(standardized(3.7 * s + 1.2), u, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def qwen():
    model = init_model("tiny-qwen3-moe", seed=random.randrange(2**31)).eval()
    return model, RouterTap(model)


def test_the_tap_reads_every_router_of_a_forward_and_stops_when_removed():
    model = init_model("tiny-qwen3-moe").eval()
    tap = RouterTap(model)
    cfg = tiny_config("tiny-qwen3-moe")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        model(ids)
    got = tap.pop()
    assert len(got) == cfg.num_hidden_layers and tap.pop() == []
    assert all(logits.shape == (18, cfg.num_local_experts) for _, logits in got)
    tap.remove()
    with torch.no_grad():
        model(ids)
    assert tap.pop() == []


def test_router_losses_on_known_logits(qwen):
    _, tap = qwen
    router = tap.routers[0]
    E, k = router.weight.shape[0], int(router.top_k)
    # every token ranks the experts by a rotation of one score vector: each expert is first equally often
    base = torch.linspace(4.0, 0.0, E)
    rotated = torch.stack([base.roll(t) for t in range(4 * E)])
    tc = TrainConfig(margin_target=0.5)
    balance, margin, z = router_losses([(router, rotated)], tc)
    assert balance.item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(z, rotated.pow(2).mean())
    gap = standardized(base[None])[0].sort(descending=True).values
    assert margin.item() == pytest.approx(max(0.0, 0.5 - (gap[k - 1] - gap[k]).item()), abs=1e-5)
    # every token on the same experts, with a wide gap after the top-k: balance far above 1, no margin loss
    same = torch.cat([torch.full((k,), 10.0), torch.zeros(E - k)]).repeat(3 * E, 1)
    balance, margin, _ = router_losses([(router, same)], tc)
    assert balance.item() > 1.5 and margin.item() == 0.0
    assert [t.item() for t in router_losses([], tc)] == [0.0, 0.0, 0.0]  # a dense model


def test_nemotron_bias_step_favours_the_experts_used_least():
    model = init_model("tiny-nemotron-h")
    router = next(m for m in RouterTap(model).routers if getattr(m, "e_score_correction_bias", None) is not None)
    E, k = router.e_score_correction_bias.numel(), int(router.top_k)
    before = router.e_score_correction_bias.clone()
    logits = torch.full((5, E), -4.0)
    logits[:, :k] = 4.0  # the first k experts take every token
    update_correction_bias([(router, logits)], rate=0.01)
    step = router.e_score_correction_bias - before
    assert torch.allclose(step[:k], torch.full((k,), -0.01)) and torch.allclose(step[k:], torch.full((E - k,), 0.01))
    assert not math.isnan(step.sum().item())
