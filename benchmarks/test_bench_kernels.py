"""benchmarks/bench_kernels.py's loops on CPU (the Triton interpreter), without a GPU to time them."""

from benchmarks.bench_kernels import SWEEP_SHAPES, sweep_pairs, tile_sweep
from tests.helpers.moe_bench import MoeShape


def test_bench_tile_sweep_on_cpu_non_gated():
    """bench_kernels.py --sweep's loop at a relu² (non-gated, Nemotron-H) shape through the interpreter: the down
    GEMM's tiles are as wide as the up GEMM's dot (not 2x, as for a gated gate_up), the default is recorded first,
    and every config's output matches the default's (a mismatch would be logged and left unranked)."""
    assert {"nemotron-3-nano", "nemotron-3-super-latent"} <= set(SWEEP_SHAPES)
    assert all(c2.block_n == c1.block_n for c1, c2 in sweep_pairs(gated=False))
    assert all(c2.block_n == 2 * c1.block_n for c1, c2 in sweep_pairs(gated=True))
    rows, logs = [], []
    shape = MoeShape("tiny-relu2", 4, 64, 48, 2, "relu2", False)
    tile_sweep(logs.append, lambda *r: rows.append(r), 8, 2.0, shape, T=37, device="cpu")
    assert rows[:2] == [("lora", "default", "default", rows[0][3]), ("no_lora", "default", "default", rows[1][3])]
    assert len(rows) > 2, logs
    assert not any("MISMATCH" in line or "failed" in line for line in logs), logs
