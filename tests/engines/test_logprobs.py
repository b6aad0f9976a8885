"""engines/logprobs.py: the chunked log-softmax equals a one-shot fp32 log_softmax of the whole logits, at chunk
sizes that do and do not divide the rows, with top-k, bias, logit scale and a logits_fn in place of the matmul."""

import pytest
import torch

from lpdiff.engines.logprobs import chunked_logprobs


def _inputs(n=37, h=24, v=53, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    return (torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randint(0, v, (n,), generator=g), g)


@pytest.mark.parametrize("chunk", [1, 7, 37, 1024])
def test_chunks_equal_one_full_log_softmax(chunk):
    hidden, head, targets, g = _inputs()
    bias = torch.randn(head.shape[0], generator=g)
    lp, ids, tlp = chunked_logprobs(hidden, head, targets, top_k=3, chunk=chunk, lm_bias=bias, logit_scale=0.7)
    full = ((hidden @ head.T + bias) * 0.7).log_softmax(-1)
    torch.testing.assert_close(lp, full.gather(1, targets[:, None])[:, 0], rtol=0, atol=1e-5)
    want_lp, want_ids = full.topk(3, dim=-1)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(tlp, want_lp, rtol=0, atol=1e-5)


def test_without_top_k_there_is_none_and_logits_fn_replaces_the_matmul():
    hidden, head, targets, _ = _inputs()
    calls = []

    def logits_fn(s, e):
        calls.append((s, e))
        return hidden[s:e] @ head.T * 2.0  # something the default path cannot produce

    lp, ids, tlp = chunked_logprobs(hidden, head, targets, chunk=10, logits_fn=logits_fn)
    assert ids is None and tlp is None
    assert calls == [(0, 10), (10, 20), (20, 30), (30, 37)]
    want = (hidden @ head.T * 2.0).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)


def test_fused_path_equals_the_plain_one():
    hidden, head, targets, _ = _inputs()
    plain, _, _ = chunked_logprobs(hidden, head, targets, chunk=16, logit_scale=1.3)
    fused, _, _ = chunked_logprobs(hidden, head, targets, chunk=16, logit_scale=1.3, fused=True)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-5)


def test_shape_mismatch_is_refused():
    hidden, head, targets, _ = _inputs()
    with pytest.raises(AssertionError):
        chunked_logprobs(hidden, head[:, :-1], targets)
