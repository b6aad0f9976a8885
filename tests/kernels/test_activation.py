"""kernels/activation.py's torch reference against the activations written out from their definitions (SiLU-gated
for Qwen, gpt-oss's clamped SwiGLU with alpha 1.702 and limit 7, Nemotron-H's squared ReLU), on fresh random
inputs wide enough to hit the clamps; an unknown name is refused naming the known ones. relu2_ (one in-place pass)
against activate's bits, through the interpreter."""

import pytest
import torch

from lpdiff.kernels.activation import ACTIVATIONS, GATED, activate, relu2_


def _h(n1):
    return torch.randn(13, n1, dtype=torch.float64) * 6  # |x| > 7 on some entries: the clamps matter


def test_silu_gated():
    h = _h(2 * 10)
    gate, up = h[:, :10], h[:, 10:]
    torch.testing.assert_close(activate(h, "silu"), gate / (1 + torch.exp(-gate)) * up)


def test_gpt_oss_clamped_swiglu():
    h = _h(2 * 10)
    gate, up = h[:, :10].clamp(max=7.0), h[:, 10:].clamp(-7.0, 7.0)
    want = (up + 1) * gate / (1 + torch.exp(-1.702 * gate))
    assert (h[:, :10] > 7).any() and (h[:, 10:].abs() > 7).any()
    torch.testing.assert_close(activate(h, "swiglu_oai"), want)


def test_relu2_is_not_gated():
    h = _h(10)
    torch.testing.assert_close(activate(h, "relu2"), torch.where(h > 0, h * h, torch.zeros_like(h)))
    assert not GATED["relu2"] and GATED["silu"] and GATED["swiglu_oai"]
    assert set(GATED) | {"none"} == set(ACTIVATIONS) and len(set(ACTIVATIONS.values())) == len(ACTIVATIONS)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        activate(_h(4), "gelu")


def _relu2_bits_check(h: torch.Tensor, want: torch.Tensor) -> None:
    got = h.clone()
    assert relu2_(got, impl="triton") is got
    bits = torch.int16 if h.dtype == torch.bfloat16 else torch.int32
    real = ~want.isnan()
    assert got[~real].isnan().all() and torch.equal(got[real].view(bits), want[real].view(bits))


def _relu2_input(dtype, device="cpu") -> torch.Tensor:
    h = torch.randn(37, 211, dtype=torch.float64).mul(40).to(dtype)  # odd sizes; squares past bf16's spacing
    h[0, :4] = torch.tensor([float("nan"), -0.0, 0.0, float("-inf")], dtype=dtype)
    return h.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_relu2_in_place_has_activates_bits(dtype):
    """Interpreted. Triton 3.6's interpreter converts fp32 to bf16 by truncation (test_gated_norm.py), so bf16 is
    checked against the square rounded that way; fp32 against activate itself. Compiled, the gpu1 case below."""
    h = _relu2_input(dtype)
    want = activate(h, "relu2")
    if dtype == torch.bfloat16:
        sq = torch.relu(h.float()).square()
        want = (sq.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # truncated: exact in bf16
        assert not torch.equal(want, activate(h, "relu2"))  # the input has squares that round up
    _relu2_bits_check(h, want)
    real = ~want.isnan()
    assert torch.equal(relu2_(h.clone(), impl="torch")[real], activate(h, "relu2")[real])


@pytest.mark.gpu1
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_relu2_compiled_has_activates_bits(dtype):
    h = _relu2_input(dtype, "cuda")
    _relu2_bits_check(h, activate(h, "relu2"))
