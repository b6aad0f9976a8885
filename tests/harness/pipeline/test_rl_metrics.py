"""RL mismatch metrics (harness/pipeline/rl_metrics.py) against values computed by hand."""

import math

import numpy as np
import pytest

from lpdiff.harness.pipeline.rl_metrics import decode_metrics


def test_every_metric_on_a_hand_computed_example():
    # r = b - a: sequence 0 -> [-0.5, 0], sequence 1 -> [2]
    m = decode_metrics([np.array([-1.0, -2.0]), np.array([-3.0])], [np.array([-1.5, -2.0]), np.array([-1.0])])
    k3 = [math.exp(-0.5) - 1 + 0.5, 0.0, math.exp(2) - 1 - 2]  # 0.10653..., 0, 4.38906...
    assert (m.num_tokens, m.num_sequences, m.num_nonfinite) == (3, 2, 0)
    assert m.k1 == pytest.approx(-0.5)  # mean(0.5, 0, -2)
    assert m.k3 == pytest.approx(sum(k3) / 3) and m.k3 == pytest.approx(1.4985289195)
    assert m.seq_k3_mean == pytest.approx(((k3[0] + k3[1]) / 2 + k3[2]) / 2)
    assert m.seq_k3_max == pytest.approx(4.3890560989)
    assert m.outside_band == pytest.approx(1 / 3)  # ratios 0.61, 1, 7.39: one outside [0.5, 2]
    assert m.k2 == pytest.approx(0.5 * (0.25 + 0 + 4) / 3)
    assert (m.max_abs, m.mean_abs) == (pytest.approx(2.0), pytest.approx(2.5 / 3))


def test_k3_clamps_the_log_ratio_to_ten_as_miles_does():
    m = decode_metrics([np.array([-50.0])], [np.array([-20.0])])  # r = 30
    assert m.k3 == pytest.approx(math.exp(10) - 1 - 10) and m.k1 == pytest.approx(-30.0)
    assert m.max_abs == pytest.approx(30.0) and m.outside_band == 1.0


def test_ratio_band_edges_are_inside():
    m = decode_metrics([np.zeros(3)], [np.log([0.5, 2.0, 2.0001])])
    assert m.outside_band == pytest.approx(1 / 3)


def test_non_finite_logprobs_are_counted_and_located():
    m = decode_metrics([np.array([-1.0, -1.0]), np.array([-1.0, np.nan])], [np.array([-1.0, -1.0])] * 2)
    assert m.num_nonfinite == 1 and m.first_nonfinite == [1, 1, "engine"] and m.num_tokens == 3 and m.max_abs == 0.0


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="sequence 0"):
        decode_metrics([np.zeros(2)], [np.zeros(3)])
