"""Probe: does a persistent grouped GEMM (one program per SM walking tiles with ``tl.range(..., flatten=True)``, so
Triton's pipeliner can overlap one tile's epilogue with the next tile's first loads) beat the one-program-per-tile
launch at the MoE's shapes on this GPU? Base GEMMs only (no LoRA, no activation), bf16, routing from moe_align.

Shapes: T tokens, K top-k, E experts, N output width, Kd reduction width, M padded rows.

    python benchmarks/persistent_probe.py [--T 4096]

Prints ms and TFLOP/s (executed FLOPs, padding included) of both launches for the gate_up-like (gathered rows,
N 2I, Kd H) and down-like (sorted rows, N H, Kd I) GEMMs of Qwen3-30B-A3B, and their max difference.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from lpdiff.kernels.moe_align import moe_align


@triton.jit
def _tile(X, W, Out, SortedIds, BlockExpert, num_pairs, N, Kd, pid_m, pid_n, TOPK: tl.constexpr,
          X_SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          K_TILES: tl.constexpr):
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    xrow = offs_m if X_SORTED else tl.minimum(pair, num_pairs - 1) // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + xrow[:, None].to(tl.int64) * Kd + offs_k[None, :]
    w_ptrs = W + e * N * Kd + (offs_n % N)[None, :] * Kd + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_TILES):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_row = pair if X_SORTED else offs_m  # as the runtime: gate_up writes sorted rows, down one row per pair
    ok = (pair < num_pairs)[:, None] & (offs_n < N)[None, :]
    tl.store(Out + out_row[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _one_tile_kernel(X, W, Out, SortedIds, BlockExpert, NumPadded, num_pairs, N, Kd, TOPK: tl.constexpr,
                     X_SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, K_TILES: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.load(NumPadded) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    if pid >= num_m * num_n:
        return
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    _tile(X, W, Out, SortedIds, BlockExpert, num_pairs, N, Kd, first_m + (pid % per_group) % size,
          (pid % per_group) // size, TOPK, X_SORTED, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES)


@triton.jit
def _persistent_kernel(X, W, Out, SortedIds, BlockExpert, NumPadded, num_pairs, N, Kd, NUM_PROGS,
                       TOPK: tl.constexpr, X_SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_TILES: tl.constexpr):
    num_m = tl.load(NumPadded) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    offs_k = tl.arange(0, BLOCK_K)
    # the tutorial's flattened loop: tile index and K step in one loop the pipeliner can prefetch across
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size
        pid_n = (tile % per_group) // size
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SortedIds + offs_m)
        xrow = offs_m if X_SORTED else tl.minimum(pair, num_pairs - 1) // TOPK
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(K_TILES):
            xt = tl.load(X + xrow[:, None].to(tl.int64) * Kd + ki * BLOCK_K + offs_k[None, :])
            wt = tl.load(W + e * N * Kd + (offs_n % N)[None, :] * Kd + ki * BLOCK_K + offs_k[:, None])
            acc = tl.dot(xt, wt, acc)
        out_row = pair if X_SORTED else offs_m
        ok = (pair < num_pairs)[:, None] & (offs_n < N)[None, :]
        tl.store(Out + out_row[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=ok)


def run(T: int, E: int = 128, K: int = 8, H: int = 2048, I: int = 768, warps: int = 8, stages: int = 4):
    from triton.testing import do_bench

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randn(T, E, generator=g, device=dev).topk(K, dim=-1).indices.to(torch.int32)
    r = moe_align(ids, None, E, 0, 128)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    M = r.sorted_ids.shape[0]
    pairs = T * K
    used = int(r.num_padded)
    for name, x, n, kd, sorted_x in (("gate_up", torch.randn(T, H, device=dev).bfloat16(), 2 * I, H, False),
                                     ("down", torch.randn(M, I, device=dev).bfloat16(), H, I, True)):
        w = (torch.randn(E, n, kd, device=dev) * kd ** -0.5).bfloat16()
        rows_out = pairs + 1 if sorted_x else M  # down: padding rows (pair == pairs) are masked anyway
        outs = {}
        for variant in ("one_tile", "persistent"):
            out = torch.zeros(rows_out, n, device=dev, dtype=torch.bfloat16)
            common = dict(TOPK=K, X_SORTED=sorted_x, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=4,
                          K_TILES=kd // 64, num_warps=warps, num_stages=stages)
            tiles = (M // 128) * triton.cdiv(n, 256)
            if variant == "one_tile":
                fn = lambda: _one_tile_kernel[(tiles,)](x, w, out, r.sorted_ids, r.block_expert, r.num_padded,  # noqa
                                                         pairs, n, kd, **common)
            else:
                fn = lambda: _persistent_kernel[(sms,)](x, w, out, r.sorted_ids, r.block_expert, r.num_padded,  # noqa
                                                         pairs, n, kd, sms, **common)
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            outs[variant] = out
            flops = 2 * used * n * kd
            print(f"T={T} {name:8s} {variant:10s} {ms:.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s (executed, {used} rows)",
                  flush=True)
        print(f"  max |one_tile - persistent| = {(outs['one_tile'].float() - outs['persistent'].float()).abs().max():.3g}",
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[4096])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    a = p.parse_args()
    for t in a.T:
        for s in a.stages:
            print(f"-- stages {s}", flush=True)
            run(t, stages=s)


if __name__ == "__main__":
    main()
