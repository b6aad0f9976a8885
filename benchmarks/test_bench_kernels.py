"""benchmarks/bench_kernels.py's loops on CPU (the Triton interpreter), without a GPU to time them."""

import torch

from benchmarks.bench_kernels import SWEEP_SHAPES, sweep_pairs, tile_sweep
from lpdiff.kernels.fused_moe_lora import moe_configs, shrink_once
from lpdiff.kernels.gemm_config import GemmConfig
from tests.helpers.moe_bench import MoeShape, make_inputs


def test_bench_tile_sweep_on_cpu_non_gated():
    """bench_kernels.py --sweep's loop at a relu² (non-gated, Nemotron-H) shape through the interpreter: the down
    GEMM's tiles are as wide as the up GEMM's dot (not 2x, as for a gated gate_up), the default is recorded first,
    and every config's output matches the default's (a mismatch would be logged and left unranked)."""
    assert {"nemotron-3-nano", "nemotron-3-super-latent"} <= set(SWEEP_SHAPES)
    assert all(c2.block_n == c1.block_n for c1, c2 in sweep_pairs(gated=False))
    assert all(c2.block_n == 2 * c1.block_n for c1, c2 in sweep_pairs(gated=True))
    # both sweep 256- and 128-wide dots (a gated block_n is half its dot)
    assert {c1.block_n for c1, _ in sweep_pairs(gated=False)} == {256, 128}
    assert {c1.block_n for c1, _ in sweep_pairs(gated=True)} == {128, 64}
    half = (GemmConfig(64, 64, 64, padding="half", n_tail=False), GemmConfig(64, 64, 64, padding="half", n_tail=False))
    assert all(c.padding == "half" and not c.n_tail for pair in sweep_pairs(base=half) for c in pair)
    rows, logs = [], []
    shape = MoeShape("tiny-relu2", 4, 64, 48, 2, "relu2", False)
    tile_sweep(logs.append, lambda *r: rows.append(r), 8, 2.0, shape, T=37, device="cpu")
    assert rows[:2] == [("lora", "default", "default", rows[0][3]), ("no_lora", "default", "default", rows[1][3])]
    assert len(rows) > 2, logs
    assert not any("MISMATCH" in line or "failed" in line for line in logs), logs
    # the configs differ from the default in their tiles only: they keep the default's padding / n_tail / expand
    moe = make_inputs(shape, 37, 1, 8, torch.bfloat16, "cpu")
    d1, _ = moe_configs(moe, shrink_once(moe.lora, "auto"))
    lora_cfgs = [r[1] for r in rows[2:] if r[0] == "lora"]
    assert lora_cfgs and all((c.padding, c.n_tail, c.expand) == (d1.padding, d1.n_tail, d1.expand) for c in lora_cfgs)
