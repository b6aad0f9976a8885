"""kernels/activation.py's torch reference against the activations written out from their definitions (SiLU-gated
for Qwen, gpt-oss's clamped SwiGLU with alpha 1.702 and limit 7, Nemotron-H's squared ReLU), on fresh random
inputs wide enough to hit the clamps; an unknown name is refused naming the known ones."""

import pytest
import torch

from lpdiff.kernels.activation import ACTIVATIONS, GATED, activate


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
