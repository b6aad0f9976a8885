"""Metrics against hand-worked cases and an independent per-position float64 implementation."""

import math

import numpy as np
import pytest

from lpdiff.harness.pipeline.metrics import (
    compare,
    delta_fidelity,
    delta_fidelity_by_group,
    full_vocab_kl,
    topk_kl_per_position,
)
from lpdiff.harness.types import LogprobRun, PromptLogprobs


def run_of(*prompts, **kw):
    """A run from (token_ids, logprobs[, topk_ids, topk_logprobs[, router_margin]]) tuples."""
    return LogprobRun([PromptLogprobs(*p) for p in prompts], dict(kw))


def test_hand_worked_two_positions():
    # d = a - b = [0.1, -0.2], worked by hand
    a = run_of(([5, 6, 7], [-1.0, -2.0]))
    b = run_of(([5, 6, 7], [-1.1, -1.8]))
    m = compare(a, b)
    tol = dict(rel=1e-6)  # the runs store float32
    assert m.num_positions == 2
    assert m.k1 == pytest.approx((-0.1 + 0.2) / 2, **tol)
    assert m.k2 == pytest.approx(0.5 * (0.01 + 0.04) / 2, **tol)
    assert m.k3 == pytest.approx(((math.exp(-0.1) - 1 + 0.1) + (math.exp(0.2) - 1 - 0.2)) / 2, **tol)
    assert m.max_abs == pytest.approx(0.2, **tol)
    assert m.mean_abs == pytest.approx(0.15, **tol)
    assert m.p99_abs == pytest.approx(0.1 + 0.99 * 0.1, **tol)  # linear interpolation between the two
    assert (m.topk_kl, m.top1_agreement, m.near_tie_share, m.clean) == (None, None, None, None)


def test_tail_fractions_and_k3_clamp():
    # |d| = 0.05, 0.3, 0.7, 1.5 -> one level crossed per position; d = +-50 exercises the [-10, 10] clamp
    a = run_of(([1, 2, 3, 4, 5], [-0.05, -0.3, -0.7, -1.5]))
    b = run_of(([1, 2, 3, 4, 5], [-0.1, 0.0, 0.0, 0.0]))
    m = compare(a, b)
    assert (m.over_0_1, m.over_0_5, m.over_1_0) == (0.75, 0.5, 0.25)
    big = compare(run_of(([1, 2, 3], [0.0, -50.0])), run_of(([1, 2, 3], [-50.0, 0.0])))
    assert big.k3 == pytest.approx(((math.exp(-10) - 1 + 10) + (math.exp(10) - 1 - 10)) / 2, rel=1e-9)
    assert big.max_abs == 50.0  # only k3 clamps


def test_identical_runs_are_all_zero():
    ids = np.array([[3, 1], [0, 2]])
    lp = np.log([[0.6, 0.3], [0.5, 0.4]])
    a = run_of(([1, 2, 3], [-0.3, -2.0], ids, lp))
    m = compare(a, a)
    for name in ("k1", "k2", "k3", "max_abs", "mean_abs", "p99_abs", "over_0_1", "topk_kl"):
        assert getattr(m, name) == 0.0, name
    assert m.top1_agreement == 1.0 and m.num_nonfinite == 0


def test_full_vocab_kl_by_hand_and_topk_with_whole_vocab_agrees():
    # vocab 3: b = (1/2, 1/4, 1/4), a = (1/4, 1/2, 1/4): KL(b||a) = 1/2 ln 2 + 1/4 ln(1/2) = ln(2) / 4
    lb, la = np.log([[0.5, 0.25, 0.25]]), np.log([[0.25, 0.5, 0.25]])
    assert full_vocab_kl(la, lb) == pytest.approx(math.log(2) / 4, rel=1e-12)
    # top-k with k = V leaves no tail, so it must equal the exact KL; ids in a different order on purpose
    kl = topk_kl_per_position(np.array([[1, 0, 2]]), la[:, [1, 0, 2]], np.array([[0, 1, 2]]), lb)
    assert kl[0] == pytest.approx(math.log(2) / 4, rel=1e-12)


def test_full_vocab_kl_matches_loop_and_checks_shapes():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 7, 11)) * 3
    la, lb = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in logits)
    want = np.mean([sum(math.exp(lb[i, v]) * (lb[i, v] - la[i, v]) for v in range(11)) for i in range(7)])
    assert full_vocab_kl(la, lb, chunk=3) == pytest.approx(want, rel=1e-12)  # chunk 3 exercises a ragged tail
    with pytest.raises(ValueError, match=r"same shape|one shape"):
        full_vocab_kl(la, lb[:, :5])


@pytest.mark.parametrize(
    "case",
    [
        # disjoint-but-one sets; the tail split leftover/(m+1) is below the k-th probability for both runs
        dict(
            a={1: 0.5, 3: 0.25},
            b={1: 0.5, 2: 0.3},
            want=0.3 * math.log(0.3 / 0.125) + 0.1 * math.log(0.1 / 0.25) + 0.1 * math.log(0.1 / 0.125),
        ),
        # a's leftover (0.65) is large, so its fill for id 2 is capped at its k-th probability 0.05
        dict(
            a={1: 0.3, 3: 0.05},
            b={1: 0.6, 2: 0.35},
            want=0.6 * math.log(0.6 / 0.3)
            + 0.35 * math.log(0.35 / 0.05)
            + 0.025 * math.log(0.025 / 0.05)
            + 0.025 * math.log(0.025 / 0.6),
        ),
    ],
)
def test_topk_kl_tail_bucket_by_hand(case):
    ids = {r: np.array([list(case[r])]) for r in "ab"}
    lps = {r: np.log([list(case[r].values())]) for r in "ab"}
    kl = topk_kl_per_position(ids["a"], lps["a"], ids["b"], lps["b"])
    assert kl[0] == pytest.approx(case["want"], rel=1e-12)


def reference_topk_kl(a_ids, a_lp, b_ids, b_lp):
    """The tail-bucket rule of topk_kl_per_position written one position at a time with dicts."""
    out = []
    for ai, al, bi, bl in zip(a_ids, a_lp, b_ids, b_lp):
        pa = {int(i): math.exp(x) for i, x in zip(ai, al)}
        pb = {int(i): math.exp(x) for i, x in zip(bi, bl)}
        union = set(pa) | set(pb)

        def with_tail(p, union=union):
            missing = union - set(p)
            leftover = max(0.0, 1 - sum(p.values()))
            each = min(*p.values(), leftover / (len(missing) + 1))
            return {**p, **dict.fromkeys(missing, each), "tail": max(0.0, leftover - len(missing) * each)}

        qa, qb = with_tail(pa), with_tail(pb)
        out.append(sum(qb[k] * math.log(qb[k] / qa[k]) for k in qb if qb[k] > 0))
    return np.array(out)


def random_run(rng, lengths, vocab=8, k=3, with_margin=False, noise=0.0, base=None):
    """Random run over `lengths` prompts; with `base`, the same tokens and logprobs perturbed by `noise`."""
    prompts = []
    for j, n in enumerate(lengths):
        tok = base.prompts[j].token_ids if base else rng.integers(0, vocab, n)
        logits = rng.normal(size=(n - 1, vocab)) * 2
        lp_full = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        ids = np.argsort(-lp_full, axis=1)[:, :k]
        lp = lp_full[np.arange(n - 1), tok[1:]]
        if base:
            lp = base.prompts[j].logprobs + rng.normal(size=n - 1) * noise
        margin = rng.uniform(0, 0.02, n) if with_margin else None
        prompts.append(PromptLogprobs(tok, lp, ids, np.take_along_axis(lp_full, ids, 1), margin))
    return LogprobRun(prompts)


def test_compare_matches_independent_float64():
    rng = np.random.default_rng(1)
    b = random_run(rng, [9, 17, 4])
    a = random_run(rng, [9, 17, 4], noise=0.3, base=b)
    m = compare(a, b)
    d = np.array([float(x) - float(y) for p, q in zip(a.prompts, b.prompts) for x, y in zip(p.logprobs, q.logprobs)])
    n = len(d)
    assert m.num_positions == n == 8 + 16 + 3
    assert m.k1 == pytest.approx(sum(-x for x in d) / n, rel=1e-12)
    assert m.k2 == pytest.approx(sum(x * x for x in d) / (2 * n), rel=1e-12)
    assert m.k3 == pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / n, rel=1e-12)
    srt = sorted(abs(x) for x in d)
    assert m.max_abs == srt[-1] and m.mean_abs == pytest.approx(sum(srt) / n, rel=1e-12)
    pos = 0.99 * (n - 1)
    assert m.p99_abs == pytest.approx(srt[int(pos)] + (pos - int(pos)) * (srt[int(pos) + 1] - srt[int(pos)]))
    assert m.over_0_1 == sum(x > 0.1 for x in srt) / n
    a_ids, b_ids = (np.concatenate([p.topk_ids for p in r.prompts]) for r in (a, b))
    a_lp, b_lp = (np.concatenate([p.topk_logprobs for p in r.prompts]) for r in (a, b))
    kl = reference_topk_kl(a_ids, a_lp, b_ids, b_lp)
    assert (kl >= -1e-12).all()  # both sides are proper distributions over the same buckets
    assert m.topk_kl == pytest.approx(kl.mean(), rel=1e-10)
    assert m.top1_agreement == pytest.approx(np.mean(a_ids[:, 0] == b_ids[:, 0]))
    assert 0 < m.top1_agreement < 1  # the random top-k sets must disagree somewhere for this test to bite


def test_near_tie_positions_reported_separately():
    # margins per token; position i depends on tokens 0..i, so a tie at token 2 flags positions 2 and 3,
    # and a tie at the last token (which no position reads) flags nothing
    a = run_of(([1, 2, 3, 4, 5], [-0.1, -0.2, -0.3, -0.4], None, None, [1, 1, 1e-5, 1, 1e-5]))
    b = run_of(([1, 2, 3, 4, 5], [-0.1, -0.2, -1.3, -2.4]))  # no routing in the reference
    m = compare(a, b, near_tie_eps=1e-3)
    assert m.near_tie_share == 0.5
    assert m.clean.num_positions == 2 and m.clean.max_abs == 0.0 and m.clean.k2 == 0.0
    assert m.max_abs == pytest.approx(2.0)
    # a tie in only the reference run flags positions as well
    m2 = compare(b, a, near_tie_eps=1e-3)
    assert m2.near_tie_share == 0.5
    assert compare(a, b, near_tie_eps=1e-6).near_tie_share == 0.0


def test_nonfinite_positions_are_counted():
    m = compare(run_of(([1, 2, 3], [float("nan"), -1.0])), run_of(([1, 2, 3], [-1.0, -1.0])))
    assert m.num_nonfinite == 1 and math.isnan(m.k2)


@pytest.mark.parametrize(
    "b_prompts, msg",
    [
        ([([1, 2, 3], [-1.0, -1.0])] * 2, "0 has 1 prompts, run 1 has 2"),  # different prompt count
        ([([1, 2, 3, 4], [-1.0, -1.0, -1.0])], "prompt 0 has 3 tokens"),  # different length
        ([([1, 9, 3], [-1.0, -1.0])], "prompt 0 token 1 is 2 in run 0 and 9"),  # different token
    ],
)
def test_different_prompts_are_refused(b_prompts, msg):
    with pytest.raises(ValueError, match="runs are over different prompts: .*" + msg):
        compare(run_of(([1, 2, 3], [-1.0, -1.0])), run_of(*b_prompts))


def test_delta_fidelity_by_hand():
    base = run_of(([1, 2, 3], [-1.0, -2.0]))
    b_lora = run_of(([1, 2, 3], [-0.75, -2.5]))  # Δb = (0.25, -0.5)
    a_lora = run_of(([1, 2, 3], [-0.75, -2.375]))  # Δa - Δb = (0, 0.125)
    want = 0.125 / math.hypot(0.25, 0.5)
    assert delta_fidelity(a_lora, base, b_lora, base) == pytest.approx(want, rel=1e-12)
    assert delta_fidelity(base, base, b_lora, base) == pytest.approx(1.0)  # a dropped adapter: output = base
    groups = {"attention": (b_lora, b_lora), "experts": (base, b_lora)}  # experts silently dropped by engine a
    assert delta_fidelity_by_group(groups, base, base) == {"attention": 0.0, "experts": pytest.approx(1.0)}
    with pytest.raises(ValueError, match="init_lora_weights=False"):
        delta_fidelity(a_lora, base, base, base)  # the reference adapter is a no-op
    with pytest.raises(ValueError, match="different prompts"):
        delta_fidelity(a_lora, base, run_of(([1, 2, 4], [-1.0, -1.0])), base)


def test_compare_adds_full_kl_from_rows():
    la, lb = np.log([[0.25, 0.5, 0.25], [0.5, 0.5, 1e-30]]), np.log([[0.5, 0.25, 0.25], [0.5, 0.5, 1e-30]])
    a = run_of(([0, 1, 0], la[[0, 1], [1, 0]]))
    b = run_of(([0, 1, 0], lb[[0, 1], [1, 0]]))
    assert compare(a, b, full_rows=(la, lb)).full_kl == pytest.approx(math.log(2) / 8, rel=1e-9)
    with pytest.raises(ValueError, match="1 positions"):
        compare(a, b, full_rows=(la[:1], lb[:1]))
