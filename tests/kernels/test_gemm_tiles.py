"""kernels/gemm_tiles.py's tile functions, launched from a small kernel here through the interpreter (CPU): the
columns a program's dot covers (gate/up interleaved or not, wrapping past N) and the bias rows it reads, against
the layout written out in Python. The whole grouped GEMM built from them is checked in test_moe.py."""

import random

import pytest
import torch

from lpdiff.kernels._triton import dual_jit, tl
from lpdiff.kernels.gemm_tiles import _bias_rows, _tile_cols


@dual_jit
def _cols(J, COL, WROW, N, INTERLEAVE: tl.constexpr, BLOCK_N: tl.constexpr, WN: tl.constexpr):
    pid_n = tl.program_id(0)
    j, col, wrow = _tile_cols(pid_n * BLOCK_N, N, INTERLEAVE, WN)
    tl.store(J + pid_n * WN + j, j)
    tl.store(COL + pid_n * WN + j, col)
    tl.store(WROW + pid_n * WN + j, wrow)


@dual_jit
def _bias(Bias, Out, OutUp, e, N, stride_be, stride_bn, SPLIT: tl.constexpr, WN: tl.constexpr):
    wrow = tl.arange(0, WN) % N
    bias, up = _bias_rows(Bias, e, wrow, N, (stride_be, stride_bn), SPLIT)
    tl.store(Out + tl.arange(0, WN), bias)
    tl.store(OutUp + tl.arange(0, WN), up)


@pytest.mark.parametrize("interleave", [True, False])
def test_tile_columns_and_weight_rows(interleave):
    block_n = random.choice([4, 8, 16])
    n = random.randint(block_n + 1, 5 * block_n)  # not a multiple of the tile: the last tile wraps
    wn = 2 * block_n if interleave else block_n
    tiles = -(-n // block_n)
    out = [torch.full((tiles * wn,), -1, dtype=torch.int32) for _ in range(3)]
    _cols[(tiles,), torch.device("cpu")](*out, n, interleave, block_n, wn)
    for t in range(tiles):
        for j in range(wn):
            col = t * block_n + (j // 2 if interleave else j)
            row = col % n + (n if interleave and j % 2 else 0)  # odd j: the up row, N rows below its gate row
            assert [int(o[t * wn + j]) for o in out] == [j, col, row], (t, j)


@pytest.mark.parametrize("split", [True, False])
def test_bias_rows_read_the_gate_and_up_rows(split):
    E, N, wn = 3, 5, 8
    bias = torch.randn(E, 2 * N)
    got, got_up = torch.zeros(wn), torch.zeros(wn)
    e = random.randrange(E)
    _bias[(1,), torch.device("cpu")](bias, got, got_up, e, N, bias.stride(0), bias.stride(1), split, wn)
    rows = torch.arange(wn) % N
    assert torch.equal(got, bias[e, rows])
    assert torch.equal(got_up, bias[e, rows + N] if split else bias[e, rows])
