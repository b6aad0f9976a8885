"""kernels/attention.py: the varlen causal attention kernel (GQA, sliding window, sinks) against its torch
reference, interpreted on CPU; the reference itself against the runtime's SDPA path (an independent
implementation); gpu1 cases run the kernel compiled at the models' shapes."""

from __future__ import annotations

import pytest
import torch

from lpdiff.kernels.attention import attention, attention_torch

CUDA = torch.cuda.is_available()


def make_qkv(lens, hq, hkv, d, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v as strided views of one packed q|k|v buffer (the runtime's layout), and cu_seqlens."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g, device=device).to(dtype)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


CASES = [
    # (lens, hq, hkv, d, window): why
    ([1, 37, 20, 64], 4, 2, 16, None),  # ragged prompts, one of length 1; GQA 2; several query blocks
    ([33, 5], 6, 3, 24, None),  # head_dim not a power of two (masked lanes); GQA 2 with 3 kv heads
    ([40, 17], 4, 4, 16, 5),  # window smaller than a block: the diagonal blocks carry the window mask too
    ([64, 29], 4, 1, 16, 20),  # window across block bounds: masked lower edge, unmasked middle; one kv head (MQA)
    ([12, 9], 2, 2, 16, 100),  # window longer than every prompt: plain causal
]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("lens,hq,hkv,d,window", CASES)
def test_kernel_matches_reference_fp32(lens, hq, hkv, d, window, sinks):
    q, k, v, cu = make_qkv(lens, hq, hkv, d)
    s = torch.randn(hq, generator=torch.Generator().manual_seed(1)) if sinks else None
    ref = attention_torch(q, k, v, cu, d**-0.5, window, s)
    got = attention(q, k, v, cu, max(lens), d**-0.5, window, s, impl="triton")
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lens,hq,hkv,d,window", [CASES[0], CASES[3]])
def test_kernel_bf16_within_rounding(lens, hq, hkv, d, window):
    """bf16 in, fp32 softmax and accumulation, P rounded to bf16 before its product with V (as FlashAttention)."""
    q, k, v, cu = make_qkv(lens, hq, hkv, d, dtype=torch.bfloat16)
    s = torch.randn(hq, generator=torch.Generator().manual_seed(1))
    ref = attention_torch(q, k, v, cu, d**-0.5, window, s)
    got = attention(q, k, v, cu, max(lens), d**-0.5, window, s, impl="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True), (7, True)])
def test_reference_matches_the_runtime_sdpa_path(window, sinks):
    """Two independent references: this file's loop over prompts and the runtime's padded SDPA (the sink as an extra
    key)."""
    from lpdiff.engines.triton.attention import sdpa
    from lpdiff.engines.triton.batch import Batch

    lens, hq, hkv, d = [3, 26, 11], 4, 2, 16
    q, k, v, cu = make_qkv(lens, hq, hkv, d)
    s = torch.randn(hq, generator=torch.Generator().manual_seed(2)) if sinks else None
    pos = torch.cat([torch.arange(n) for n in lens])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    batch = Batch(pos, pos, seq, lens, cu, None, None, None)
    torch.testing.assert_close(
        attention_torch(q, k, v, cu, d**-0.5, window, s), sdpa(q, k, v, batch, d**-0.5, window, s), atol=2e-6, rtol=1e-5
    )


def test_sinks_only_scale_the_rows_down():
    """A sink takes softmax mass without adding value: the output is the sink-free output times
    sigmoid(logsumexp - sink) per row; a very negative sink changes nothing; a huge one drives rows to 0."""
    lens, hq, d = [21, 8], 2, 16
    q, k, v, cu = make_qkv(lens, hq, hq, d)
    plain = attention(q, k, v, cu, max(lens), d**-0.5, None, None, impl="triton")
    low = attention(q, k, v, cu, max(lens), d**-0.5, None, torch.full((hq,), -1e4), impl="triton")
    torch.testing.assert_close(low, plain, atol=1e-6, rtol=1e-6)
    high = attention(q, k, v, cu, max(lens), d**-0.5, None, torch.full((hq,), 1e4), impl="triton")
    assert high.abs().max() < 1e-30
    mid = attention(q, k, v, cu, max(lens), d**-0.5, None, torch.tensor([0.5, 3.0]), impl="triton")
    ratio = mid / plain
    assert (ratio > 0).all() and (ratio < 1).all()


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda q, k, v, cu: (q, k[:, :1, :8], v[:, :1, :8], cu), "wants q"),
        (lambda q, k, v, cu: (q[:, :3], k, v, cu), "multiple of kv heads"),
        (lambda q, k, v, cu: (q, k, v, cu.long()), "int32"),
        (lambda q, k, v, cu: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu), "stride 1"),
    ],
)
def test_bad_input_gives_one_clear_error(bad, match):
    q, k, v, cu = make_qkv([5, 6], 4, 2, 16)
    with pytest.raises(ValueError, match=match):
        attention(*bad(q, k, v, cu), 6, 0.25)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, cu, 6, 0.25, window=0)
    with pytest.raises(ValueError, match="one logit per query head"):
        attention(q, k, v, cu, 6, 0.25, sinks=torch.zeros(3))
    # 64 x 128 tiles read keys past the diagonal unmasked (max |d| 1.25 on an H200) before this check
    with pytest.raises(ValueError, match="must divide BLOCK_M"):
        attention(q, k, v, cu, 6, 0.25, impl="triton", config=dict(BLOCK_M=16, BLOCK_N=32))


@pytest.mark.parametrize("tiles", [(32, 16), (32, 32)])
def test_tiles_with_several_key_blocks_per_query_block(tiles):
    """BLOCK_M a multiple of BLOCK_N: the diagonal stage walks several key blocks, the window's edge moves."""
    lens, hq, hkv, d = [70, 33], 4, 2, 16
    q, k, v, cu = make_qkv(lens, hq, hkv, d)
    s = torch.randn(hq, generator=torch.Generator().manual_seed(3))
    for window in (None, 9, 40):
        got = attention(
            q, k, v, cu, max(lens), d**-0.5, window, s, impl="triton", config=dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1])
        )
        torch.testing.assert_close(got, attention_torch(q, k, v, cu, d**-0.5, window, s), atol=2e-6, rtol=1e-5)


GPU_CASES = [
    # (lens, hq, hkv, d, window, sinks): why
    ([512] * 8, 64, 8, 64, 128, True),  # gpt-oss-20b's sliding layers at the e2e batch
    ([512] * 8, 64, 8, 64, None, True),  # its full layers
    ([700, 3, 129, 64, 1000], 64, 8, 64, 128, True),  # ragged, with prompts shorter and longer than a block
    ([512] * 8, 32, 4, 128, None, False),  # Qwen3-30B-A3B (head_dim 128)
    ([300, 77], 16, 2, 256, 128, True),  # head_dim 256: the smaller tiles that fit shared memory
]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"h{c[1]}-d{c[3]}-w{c[4]}-n{len(c[0])}")
@pytest.mark.gpu1
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernel_gpu(case, dtype, tol):
    lens, hq, hkv, d, window, sinks = case
    q, k, v, cu = make_qkv(lens, hq, hkv, d, dtype=dtype, device="cuda")
    s = torch.randn(hq, device="cuda") if sinks else None
    torch.full((1 << 28,), float("nan"), device="cuda")  # freed at once: unwritten outputs would read NaN
    got = attention(q, k, v, cu, max(lens), d**-0.5, window, s)
    ref = attention_torch(q, k, v, cu, d**-0.5, window, s)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(got, attention(q, k, v, cu, max(lens), d**-0.5, window, s)), "reruns must be bit-identical"
