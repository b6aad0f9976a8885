"""kernels/logprob.py: the one-pass target logprob kernel against its torch reference (fresh random logits, odd
vocabularies, a spiked row, both ends of the vocabulary as targets). CPU: Triton interpreter; GPU (gpu1): compiled,
at Qwen3's vocabulary."""

import pytest
import torch

from lpdiff.kernels.logprob import target_logprobs, target_logprobs_torch


def _case(n: int, v: int, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 4).to(dtype)
    logits[n // 2, v // 3] = 90.0  # one row dominated by a single logit: the online max must rescale the sum
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0], targets[-1] = 0, v - 1  # both ends of the vocabulary, the last one in the masked tail block
    return logits.to(device), targets.to(device)


@pytest.mark.parametrize(
    "n,v,block_v,scale,dtype,tol",
    [
        (5, 1007, 256, 1.0, torch.float32, 1e-5),  # several blocks and a masked tail (1007 = 3 x 256 + 239)
        (3, 100, 128, 1.0, torch.float32, 1e-5),  # the whole vocabulary inside one partly masked block
        (4, 777, 128, 0.5, torch.float32, 1e-5),  # a logit scale (models that scale logits before the softmax)
        (5, 1007, 256, 1.0, torch.bfloat16, 1e-5),  # bf16 logits: read as they are, summed in fp32
    ],
)
def test_kernel_matches_reference(n, v, block_v, scale, dtype, tol):
    logits, targets = _case(n, v, dtype)
    got = target_logprobs(logits, targets, scale, impl="triton", block_v=block_v)
    want = target_logprobs_torch(logits, targets, scale)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_bad_input_names_the_problem():
    logits, targets = _case(3, 50, torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        target_logprobs(logits.t(), targets)
    with pytest.raises(ValueError, match="targets must be"):
        target_logprobs(logits, targets[:2])


@pytest.mark.gpu1
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_on_gpu_at_qwen3_vocab(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    logits, targets = _case(1024, 151936, dtype, "cuda")
    torch.testing.assert_close(
        target_logprobs(logits, targets), target_logprobs_torch(logits, targets), atol=2e-5, rtol=2e-5
    )
