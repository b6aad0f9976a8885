"""Seeded Mamba-2 SSD scan inputs over packed prompts, shared by the scan kernels' tests (tests/kernels/) and
benchmarks/bench_ssd.py: x, B, C cut out of one wider (T, conv width) tensor as the mixer cuts them (views with a row
stride wider than their width), dt discretised as the model does, and each prompt's boundaries both ways (cu_seqlens
for ssd_varlen, seq_idx for ssd_chunked)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lpdiff.kernels.ssd import discretise_dt


@dataclass
class ScanInputs:
    x: torch.Tensor  # (T, h, p)
    dt: torch.Tensor  # (T, h) discretised
    A: torch.Tensor  # (h,) fp32, negative
    B: torch.Tensor  # (T, g, n)
    C: torch.Tensor
    D: torch.Tensor  # (h,) fp32
    cu_seqlens: torch.Tensor  # (S+1,) int32
    seq_idx: torch.Tensor  # (T,) int64, as Batch.seq

    def args(self) -> tuple:
        return self.x, self.dt, self.A, self.B, self.C, self.D


def scan_inputs(lens, h, p, g, n, dtype=torch.float32, device="cpu", seed=0) -> ScanInputs:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    xbc = torch.randn(T, h * p + 2 * g * n, generator=gen).to(device, dtype)
    x, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
    dt_raw = (torch.randn(T, h, generator=gen) - 1).to(device, dtype)
    dt_bias = torch.rand(h, generator=gen).to(device)
    A = -torch.exp(torch.rand(h, generator=gen) * 2).to(device)  # decay rates 1..7.4 per unit dt
    D = torch.randn(h, generator=gen).to(device)
    lengths = torch.tensor(lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device, torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lengths).to(device)
    return ScanInputs(
        x.reshape(T, h, p), discretise_dt(dt_raw, dt_bias, 1e-3), A, B.reshape(T, g, n), C.reshape(T, g, n), D, cu, seq
    )
