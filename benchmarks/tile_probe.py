"""Probe: the expert GEMMs' tiles one GEMM at a time (bench_kernels' sweep ties gate_up's and down's tiles
together). Each GEMM of moe_forward_triton at its production launch (padding "half", LoRA expand "loop" with the
shrink precomputed), timed alone with do_bench, with one rank-32 adapter and without, at T = 4096, bf16, for tiles
(block_m 128 shared with the alignment, block_n, block_k, warps, stages, group_m). Smaller tiles with fewer
warps and stages fit two programs per SM, so one's epilogue can overlap the other's K-loop.

    python benchmarks/tile_probe.py [--shapes qwen3-30b-a3b gpt-oss-20b]      # GPU
"""
import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_kernels import SHAPES, bench, make_inputs  # noqa: E402
from lpdiff.kernels.fused_moe_lora import (expert_lora_kwargs, expert_shrink, launch_gemm, moe_configs,  # noqa: E402
                                    shrink_once)
from lpdiff.kernels.moe_align import moe_align  # noqa: E402

# (block_n, block_k, warps, stages, group_m); block_n counts output columns (gate_up's dot is twice as wide)
GATE_UP = [(128, 64, 8, 4, 4), (128, 64, 8, 3, 4), (128, 64, 8, 4, 8), (64, 64, 4, 3, 4), (64, 64, 4, 4, 4),
           (64, 64, 8, 4, 4), (128, 32, 8, 6, 4)]
DOWN = [(256, 64, 8, 4, 4), (256, 64, 8, 3, 4), (256, 64, 8, 4, 8), (128, 64, 4, 3, 4), (128, 64, 4, 4, 4),
        (128, 64, 8, 4, 4), (256, 32, 8, 6, 4), (128, 128, 4, 2, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=[s.name for s in SHAPES])
    args = ap.parse_args()
    print(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for s in SHAPES:
        if s.name not in args.shapes:
            continue
        p = make_inputs(s, 4096, 1, 32, torch.bfloat16, "cuda")
        x, lora = p["x"], p["lora"]
        c1, c2 = moe_configs(x, p["topk_ids"], p["w_gate_up"], p["activation"], lora, shrink_once(lora, "once"))
        r = moe_align(p["topk_ids"], p["token_adapter"], s.E, 1, c1.block_m, impl="triton")
        r0 = moe_align(p["topk_ids"], None, s.E, 0, c1.block_m, impl="triton")
        M = r.sorted_ids.shape[0]
        inter = torch.randn(M, s.I, dtype=x.dtype, device=x.device)
        y = torch.empty(4096 * s.K, s.H, dtype=x.dtype, device=x.device)
        tw = p["topk_weights"].reshape(-1).float()
        s1 = expert_shrink(x, lora, "gate_up", r)
        s2 = expert_shrink(inter, lora, "down", r)
        out1 = torch.empty(max(M, r0.sorted_ids.shape[0]), s.I, dtype=x.dtype, device=x.device)
        for gemm, tiles, base in (("gate_up", GATE_UP, c1), ("down", DOWN, c2)):
            ref = {}
            for bn, bk, warps, stages, gm in tiles:
                cfg = replace(base, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_m=gm)
                line = f"{s.name} {gemm:7s} bn {bn:3d} bk {bk:3d} w{warps} s{stages} g{gm}:"
                for tag, routing, kw in (("lora", r, expert_lora_kwargs(lora, gemm, s1 if gemm == "gate_up" else s2)),
                                         ("base", r0, {})):
                    if gemm == "gate_up":
                        f = lambda: launch_gemm(x, p["w_gate_up"], out1, routing, cfg, x_sorted=False,  # noqa: E731
                                                out_sorted=True, activation=s.activation, bias=p["b_gate_up"], **kw)
                        res = out1
                    else:
                        f = lambda: launch_gemm(inter, p["w_down"], y, routing, cfg, x_sorted=True,  # noqa: E731
                                                out_sorted=False, bias=p["b_down"], topk_weights=tw, **kw)
                        res = y
                    try:
                        f()
                        torch.cuda.synchronize()
                        # gate_up: the rows this alignment uses (the base one pads fewer groups than the LoRA one)
                        rows = res[:routing.sorted_ids.shape[0]]
                        got = (rows[routing.sorted_ids < routing.num_pairs] if gemm == "gate_up" else res).float()
                        if tag not in ref:
                            ref[tag] = got
                        err = (got - ref[tag]).abs().max().item()
                        ms = bench(f, rep=200)
                        line += f"  {tag} {ms * 1e3:7.1f} us (max |d| vs first {err:.1e})"
                    except Exception as exc:  # noqa: BLE001 — a probe: a tile that does not fit is a result too
                        line += f"  {tag} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
