"""benchmarks/nemotron_parity.py on CPU: the tiny zoo Nemotron-H through the same measurement as a GPU run."""

import numpy as np
import pytest

from benchmarks import nemotron_parity
from lpdiff.harness.types import PromptLogprobs


@pytest.mark.filterwarnings("ignore")
def test_tiny_zoo_rows_are_exact_and_adapters_move_the_output():
    rows = nemotron_parity.measure("tiny-nemotron-h", 3, [16, 45, 7], "cpu")  # M E *
    assert [r["choice"] for r in rows] == ["-", "all", "mixers", "moe_pe", "mixed"]
    for r in rows:
        assert r["max_d_before_tie"] <= r["max_d"] <= 1e-4, r
        assert (r["adapter_effect"] > 1e-2) == (r["choice"] != "-"), r


def test_positions_after_a_near_tie_are_left_out_of_the_clean_maximum():
    def run(lp, margin):
        return PromptLogprobs(
            token_ids=np.arange(len(lp) + 1),
            logprobs=np.asarray(lp, np.float32),
            router_margin=np.asarray(margin, np.float32),
        )

    ref = [run([0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])]
    got = [run([1e-6, 0.5, 0.5], [1.0, 1e-7, 1.0, 1.0])]  # a tie at token 1: positions 1 and 2 may flip
    full, clean = nemotron_parity.max_diffs(got, ref)
    assert full == pytest.approx(0.5) and clean == pytest.approx(1e-6)
