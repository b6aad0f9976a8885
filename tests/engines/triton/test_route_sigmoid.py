"""Nemotron-H's sigmoid router kernel (engines/triton/moe.py route_sigmoid / _route_sigmoid_kernel) against its torch
reference (route_sigmoid_torch): through the Triton interpreter on CPU in a child Python (TRITON_INTERPRET=1 must be
set before triton is imported, engines/triton/_jit.py), and compiled on a GPU (gpu1) at the real models' sizes,
bit for bit where the kernel claims the reference's rounding, and replayed from a CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import REPO

# (experts, top-k): Nano (128, 6) and Super (512, 22) and their crossings; 40 not a power of two (masked columns);
# K == E: every expert chosen, the margin is +inf
SHAPES = [(128, 6), (512, 22), (128, 22), (512, 6), (40, 6), (8, 8)]
T = 37  # not a multiple of either row block (16 at E <= 128, 4 at E = 512)


def spaced_inputs(t: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, e) fp32 logits and an (e,) bias whose biased choice sigmoid(logit) + bias is, in each row, a random
    permutation of values 0.4 / e apart (a few ulps of sigmoid rounding cannot reorder them, so ids compare exactly),
    while the unbiased scores, the bias spread over 0.4, rank the experts otherwise: a kernel choosing by the
    scores, or weighing by the choice, fails."""
    bias = (torch.rand(e, generator=g) - 0.5) * 0.4
    target = 0.3 + 0.4 * torch.argsort(torch.rand(t, e, generator=g), dim=1).float() / e
    scores = (target - bias).double()
    return (scores.log() - (-scores).log1p()).float(), bias


def check_interpreted() -> None:
    import lpdiff.engines.triton.moe as moe
    from lpdiff.engines.triton._jit import INTERPRETED
    from lpdiff.harness.spec.routing import topk_margin

    assert INTERPRETED, "run through the test (it sets TRITON_INTERPRET=1)"
    g = torch.Generator().manual_seed(46)
    for E, K in SHAPES:
        for norm, scaling in ((True, 2.5), (False, 5.0)):
            what = f"E={E} K={K} norm={norm}"
            logits, bias = spaced_inputs(T, E, g)
            ids, w, m = moe.route_sigmoid(logits, bias, K, norm, scaling, impl="triton")
            rids, rw, rm = moe.route_sigmoid_torch(logits, bias, K, norm, scaling)
            assert ids.dtype == torch.int64 and w.dtype == m.dtype == torch.float32, what
            assert torch.equal(ids, rids), what
            torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7, msg=what + " weights")
            if K < E:
                assert (rm > 0.3 / E).all(), what  # the inputs are spaced as meant
                torch.testing.assert_close(m, rm, rtol=0, atol=1e-6, msg=what + " margin")
            else:
                assert torch.isinf(m).all() and torch.isinf(rm).all(), what
        if K < E:  # plain normal logits and bias: ties within rounding may swap ids, not the chosen values
            logits, bias = 3 * torch.randn(T, E, generator=g), 0.1 * torch.randn(E, generator=g)
            ids, w, m = moe.route_sigmoid(logits, bias, K, True, 2.5, impl="triton")
            choice = logits.sigmoid() + bias
            torch.testing.assert_close(choice.gather(1, ids), choice.topk(K).values, rtol=0, atol=1e-6)
            torch.testing.assert_close(m, topk_margin(choice, K), rtol=0, atol=1e-6)
        check_min_into(moe, E, K, g)
    check_tie(moe, g)
    # group-limited picks (topk_group < n_group) keep the torch reference, bit for bit
    logits, bias = spaced_inputs(T, 64, g)
    got = moe.route_sigmoid(logits, bias, 6, True, 2.5, (8, 3), impl="triton")
    for a, b in zip(got, moe.route_sigmoid_torch(logits, bias, 6, True, 2.5, (8, 3))):
        assert torch.equal(a, b), "grouped"
    print("all sigmoid-router checks passed")


def check_tie(moe, g: torch.Generator) -> None:
    """Two experts with bit-equal choice at the k-th place: the lower index is chosen (the same pick on every run,
    whatever the row block), the margin is 0 and the other one stays out."""
    E, K = 128, 6
    logits, bias = spaced_inputs(T, E, g)
    choice = logits.sigmoid() + bias
    order = choice[5].argsort(descending=True)
    kth, out = int(order[K - 1]), int(order[K + 3])  # move a non-chosen expert onto the k-th one's choice
    bias[out] = bias[kth]
    logits[5, out] = logits[5, kth]
    ids, _, m = moe.route_sigmoid(logits, bias, K, True, 2.5, impl="triton")
    assert m[5] == 0 and int(ids[5, K - 1]) == min(kth, out) and max(kth, out) not in ids[5].tolist(), "tie"


def check_min_into(moe, E: int, K: int, g: torch.Generator) -> None:
    """MIN_INTO: the margin buffer holds the earlier layers' minimum (some rows below this layer's, some above) and
    is lowered in place; under a routing capture the layer's own margin is recorded and the minimum still kept."""
    logits, bias = spaced_inputs(T, E, g)
    rids, rw, rm = moe.route_sigmoid_torch(logits, bias, K, True, 2.5)
    prev = torch.rand(T, generator=g) * 2 * torch.where(torch.isinf(rm), 1.0, rm + 1e-3)
    if K < E:
        assert ((prev < rm).sum() > 3) and ((prev > rm).sum() > 3), "both sides of the minimum"
    for capture in (False, True):
        acc = prev.clone()
        moe.recording = [] if capture else None
        try:
            ids, w, m = moe.route_sigmoid(logits, bias, K, True, 2.5, impl="triton", min_into=acc)
            recorded = moe.recording
        finally:
            moe.recording = None
        what = f"min_into E={E} K={K} capture={capture}"
        assert m is acc and torch.equal(ids, rids), what
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7, msg=what)
        torch.testing.assert_close(acc, torch.minimum(prev, rm), rtol=0, atol=1e-6, msg=what)
        if capture:
            assert recorded is not None and len(recorded) == 1, what
            own = recorded[0][2]
            assert torch.equal(recorded[0][0], ids) and own is not acc, what
            assert torch.equal(torch.isinf(own), torch.isinf(rm)), what
            if K < E:
                torch.testing.assert_close(own, rm, rtol=0, atol=1e-6, msg=what + " recorded")


def test_sigmoid_router_kernel_matches_torch_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all sigmoid-router checks passed" in proc.stdout


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _gpu_inputs(E: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = 4096 + 37  # the bench's 8 x 512 tokens and a ragged tail
    return torch.randn(T, E, generator=g, device="cuda"), 0.05 * torch.randn(E, generator=g, device="cuda")


GPU_SHAPES = [(512, 22, 5.0), (128, 6, 2.5)]  # Super, Nano: experts, top-k, routed_scaling_factor


@pytest.mark.gpu1
@needs_gpu
@pytest.mark.parametrize("E,K,scaling", GPU_SHAPES)
def test_sigmoid_router_kernel_on_gpu(E, K, scaling):
    """Compiled at Super's and Nano's sizes against the reference: the chosen choice values in the reference's order
    (ids equal as sets wherever the k-th and (k+1)-th choice differ by more than rounding), margins and weights within
    fp32 rounding; and from a CUDA graph, with the running minimum folded in, the same bits as eager on fresh
    inputs."""
    import lpdiff.engines.triton.moe as moe

    logits, bias = _gpu_inputs(E, E + K)
    choice = logits.sigmoid() + bias
    for norm, scale in ((False, 1.0), (True, scaling)):
        ids, w, m = moe.route_sigmoid(logits, bias, K, norm, scale, impl="triton")
        rids, rw, rm = moe.route_sigmoid_torch(logits, bias, K, norm, scale)
        torch.testing.assert_close(choice.gather(1, ids), choice.topk(K).values, rtol=0, atol=1e-6)
        apart = rm > 1e-6
        assert apart.float().mean() > 0.99
        assert torch.equal(ids.sort(1).values[apart], rids.sort(1).values[apart]), "the chosen experts"
        torch.testing.assert_close(m, rm, rtol=0, atol=1e-6)
        want = logits.sigmoid().gather(1, ids)  # the reference's weights for the kernel's ids (tied ids may swap)
        if norm:
            want = want / (want.sum(-1, keepdim=True) + 1e-20) * scale
        torch.testing.assert_close(w, want, rtol=2e-6, atol=0)
        same = (ids == rids).all(1)
        assert same.float().mean() > 0.99
        torch.testing.assert_close(w[same], rw[same], rtol=2e-6, atol=0)

    static_logits, prev = logits.clone(), 0.01 * torch.rand(logits.shape[0], device="cuda")
    margin = prev.clone()
    moe.route_sigmoid(static_logits, bias, K, True, scaling, impl="triton", min_into=margin)  # compiles, outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gw, _ = moe.route_sigmoid(static_logits, bias, K, True, scaling, impl="triton", min_into=margin)
    fresh, _ = _gpu_inputs(E, E + K + 1)
    static_logits.copy_(fresh)
    margin.copy_(prev)
    graph.replay()
    ids, w, m = moe.route_sigmoid(fresh, bias, K, True, scaling, impl="triton")
    assert torch.equal(gids, ids) and torch.equal(gw, w), "graph replay"
    assert torch.equal(margin, torch.minimum(prev, m)), "graph replay's running minimum"
    assert (prev < m).any() and (prev > m).any()


@pytest.mark.gpu1
@needs_gpu
@pytest.mark.parametrize("E,K,scaling", GPU_SHAPES)
def test_sigmoid_router_kernel_bits_on_gpu(E, K, scaling):
    """The kernel's sigmoid is torch's CUDA one bit for bit (libdevice's expf, the same fp32 contraction of 1 + exp
    into one fma, IEEE division: div.rn), so the choice, hence the chosen values in order and the margins, are the
    reference's bits, and so are the unnormalised weights. Only the normalised weights' sum order differs."""
    import lpdiff.engines.triton.moe as moe

    logits, bias = _gpu_inputs(E, E + K)
    scores = logits.sigmoid()
    choice = scores + bias
    ids, w, m = moe.route_sigmoid(logits, bias, K, False, 1.0, impl="triton")
    _, _, rm = moe.route_sigmoid_torch(logits, bias, K, False, 1.0)
    for what, got, want in (
        ("unnormalised weights: sigmoid", w, scores.gather(1, ids)),
        ("chosen values", choice.gather(1, ids), choice.topk(K).values),
        ("margins", m, rm),
    ):
        off = got != want
        assert not off.any(), f"{what}: {int(off.sum())} of {off.numel()} differ, most by {(got - want).abs().max()}"


if __name__ == "__main__":
    check_interpreted()
