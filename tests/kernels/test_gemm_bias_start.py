"""The grouped GEMM's bias is the first term of its sum in every launch variant, checked on the kernels as Triton
compiles them for sm90 (on CPU, no GPU). The interpreter cannot show this: it runs the kernel's Python as written,
while compiling runs Triton's combine pass, which rewrites dot(x, w, 0) + bias into dot(x, w, bias) wherever a
one-step K-loop (Kdim <= BLOCK_K) is folded away. A bias added after the K-loop thus rounded as bias + x0 w0 + ...
in the no-LoRA down GEMM of tiny gpt-oss (Kdim 40) and as (x0 w0 + ...) + bias beside a LoRA (whose expand "loop"
adds K steps): base rows moved by up to 2.4e-7 beside adapter rows on an H200 (fp32), failing
tests/engines/triton/test_base_rows_neutral.py's gpu1 case there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def launches():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-m", "tests.helpers.acc_start"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_every_biased_accumulator_starts_from_the_bias(launches):
    """Each output dot's accumulator starts from the broadcast bias, never from zeros, in every variant: so no
    variant can add the bias at another point of the sum than another (the LoRA's shrink dot, BLOCK_R wide, starts
    from zeros as it should)."""
    biased = [x for x in launches if x["HAS_BIAS"]]
    assert len(biased) == len(launches) == 14
    assert {x["K_TILES"] for x in biased} == {1, 2}, "the shape must keep a one-step K-loop (the one folded)"
    assert {x["LORA"] for x in biased} == {0, 1, 2} and {x["EXPAND"] for x in biased if x["LORA"] == 2} == {0, 1, 2}
    for x in biased:
        out = [d for d in x["dots"] if d["width"] != x["BLOCK_R"] or x["LORA"] == 0]
        assert out, x
        where = f"{x['variant']} {x['gemm']} (LORA {x['LORA']}, EXPAND {x['EXPAND']}, K_TILES {x['K_TILES']})"
        assert not any(d["zero"] for d in out), f"{where}: a dot's sum starts from zeros: {out}"
        assert any(d["start"] == "tt.broadcast" for d in out), f"{where}: no dot starts from the bias: {out}"
