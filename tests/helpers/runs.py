"""Logprob runs for store tests that are what an engine returns: a log-softmax of random logits per position, the
actual next token's logprob and the top-k taken from the same distribution (so the store's read-side checks,
which a file written by anyone else must pass, hold for them)."""

from __future__ import annotations

import numpy as np

from lpdiff.harness.pipeline.store_key import baseline_key
from lpdiff.harness.types import LogprobRun, ModelSpec, PromptLogprobs

VOCAB = 50


def engine_like_run(
    prompts,
    top_k: int | None = 2,
    shift: float = 0.0,
    seed: int = 0,
    wall: float = 1.0,
    vocab: int = VOCAB,
    meta: dict | None = None,
) -> LogprobRun:
    """``shift`` moves every logit of the actual tokens (other numbers, still consistent). ``top_k`` None: an
    engine that gives neither top-k nor router margins."""
    rng = np.random.default_rng(seed)
    out = []
    for p in prompts:
        n = len(p)
        logits = rng.normal(size=(n - 1, vocab))
        nxt = np.asarray(p[1:])
        logits[np.arange(n - 1), nxt] += shift
        lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        actual = lp[np.arange(n - 1), nxt].astype(np.float32)
        if top_k is None:
            out.append(PromptLogprobs(p, actual))
            continue
        ids = np.argsort(-lp, axis=1, kind="stable")[:, :top_k]
        out.append(PromptLogprobs(p, actual, ids, np.take_along_axis(lp, ids, 1).astype(np.float32), rng.random(n)))
    return LogprobRun(out, {"engine": "hf", "wall_s": wall, "vocab_size": vocab, **(meta or {})})


# A small store fixture set: two prompts, one tiny model identity, a key builder, exact equality of two runs.
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


def model(seed=0, name="tiny-moe", num_layers=None):
    return ModelSpec(
        name=name, arch="qwen3_moe", config={"hidden_size": 8}, init_seed=seed, init_recipe="r1", num_layers=num_layers
    )


def make_run(shift=0.0, top_k=2, wall=1.0, prompts=PROMPTS):
    return engine_like_run(prompts, top_k=top_k, shift=shift, wall=wall)


def key(**kw):
    args = dict(model=model(), adapter=None, prompts=PROMPTS, dtype="float32", tp=1, engine="hf", top_k=2)
    args.update(kw)
    return baseline_key(**args)


def assert_same(a: LogprobRun, b: LogprobRun):
    xa, xb = a.to_arrays(), b.to_arrays()
    assert xa.keys() == xb.keys()
    for k in xa:
        assert xa[k].dtype == xb[k].dtype and np.array_equal(xa[k], xb[k]), k
