"""Nemotron-H's SSD scan alone, the triton runtime's two implementations side by side (its mamba_scan option): the
recurrence (kernels/ssd_varlen.py, one program per prompt x head x 32 head_dim rows walking the tokens) and
mamba_ssm's chunked kernels (kernels/ssd_chunked.py), one mixer layer at Nemotron-3 Nano's or Super's shapes (TP 1),
bf16, over packed prompt layouts; each output checked against the fp32 torch reference
(ssd_varlen.ssd_scan_varlen_torch on the same bf16 inputs), each timed with triton.testing.do_bench (median).

    python -m benchmarks.bench_ssd [--model nano|super] [--layouts 8x512,1x4096,...] [--out DIR] [--commit SHA]
    python -m benchmarks.bench_ssd --check   # CPU: small shapes, the kernels interpreted in fp32, no timing

Columns: rel_err = max |y - ref| / max |ref|; floor_ms = max(FLOPs / measured bf16 matmul rate, bytes / measured
copy bandwidth), FLOPs and bytes of the scan as benchmarks/sol_hybrid.py counts them in its bound (the four batched
GEMMs C B^T, (C B^T) x, B^T x, C S per chunk; x, B, C read, dt read in fp32, y written, the chunk states written and
read once in the model dtype); pct_floor = floor / measured; fwd_ms = ms x the model's mamba layers (Nano 23, Super
40), the scan's share of one forward at that layout. Writes DIR/ssd.csv when --out is given; prints a table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os

import torch

from benchmarks.bench_kernels import ceilings
from lpdiff.kernels.ssd_chunked import ssd_scan_chunked
from lpdiff.kernels.ssd_varlen import ssd_scan_varlen, ssd_scan_varlen_torch
from tests.helpers.ssd import scan_inputs

# per model: mamba heads, head dim, groups, state, chunk, mamba layers (hub_configs' hybrid_override_pattern 'M's)
MODELS = {
    "nano": dict(h=64, p=64, g=8, n=128, chunk=128, layers=23),
    "super": dict(h=128, p=64, g=8, n=128, chunk=128, layers=40),
    "check": dict(h=4, p=8, g=2, n=16, chunk=16, layers=1),  # --check: interpreted on CPU
}
LAYOUTS = "8x512,1x4096,32x128,ragged"
RAGGED = [300, 17, 1024, 1, 64, 129, 2048, 513]  # 4096 tokens, boundaries anywhere in a chunk
COLUMNS = ["date", "commit", "gpu", "model", "layout", "T", "impl", "dtype", "ms", "fwd_ms", "rel_err"]
COLUMNS += ["floor_ms", "pct_floor"]


def parse_layout(name: str) -> list[int]:
    if name == "ragged":
        return RAGGED
    count, length = name.split("x")
    return [int(length)] * int(count)


def floor_ms(lens: list[int], m: dict, matmul_rate: float, bandwidth: float, el: int = 2) -> float:
    h, p, g, n, c = m["h"], m["p"], m["g"], m["n"], m["chunk"]
    T = sum(lens)
    chunks = sum(math.ceil(L / c) for L in lens)
    flops = 2 * chunks * (g * c * n * c + h * (c * c * p + n * c * p + c * n * p))
    nbytes = T * (h * p + 2 * g * n) * el + T * h * 4 + T * h * p * el + 2 * chunks * h * n * p * el
    return 1e3 * max(flops / matmul_rate, nbytes / bandwidth)


def run_layout(model: str, layout: str, device: str, dtype: torch.dtype, rates, timed: bool) -> list[dict]:
    m = MODELS[model]
    lens = parse_layout(layout)
    s = scan_inputs(lens, m["h"], m["p"], m["g"], m["n"], dtype=dtype, device=device, seed=11)
    ref = ssd_scan_varlen_torch(*(t.float() for t in s.args()), s.cu_seqlens, chunk=64)
    scale = float(ref.abs().max())
    impls = {
        "recurrence": lambda: ssd_scan_varlen(*s.args(), s.cu_seqlens, impl="triton"),
        "chunked": lambda: ssd_scan_chunked(*s.args(), s.seq_idx, chunk=m["chunk"]),
    }
    floor = floor_ms(lens, m, *rates) if timed else float("nan")
    rows = []
    for impl, fn in impls.items():
        y = fn()  # the chunked kernels autotune on their first call
        err = float((y.float() - ref).abs().max()) / scale
        ms = float("nan")
        if timed:
            import triton.testing

            ms = triton.testing.do_bench(fn, return_mode="median")
        rows.append(
            dict(
                model=model,
                layout=layout,
                T=sum(lens),
                impl=impl,
                dtype=str(dtype).removeprefix("torch."),
                ms=f"{ms:.4f}",
                fwd_ms=f"{ms * m['layers']:.3f}",
                rel_err=f"{err:.2e}",
                floor_ms=f"{floor:.4f}",
                pct_floor=f"{100 * floor / ms:.1f}" if timed else "",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("nano", "super"), default="nano")
    ap.add_argument("--layouts", default=LAYOUTS, help="comma-separated BxL or 'ragged' (default %(default)s)")
    ap.add_argument("--out", default=None, help="folder for ssd.csv")
    ap.add_argument("--commit", default=os.environ.get("LPDIFF_COMMIT", "unknown"))
    ap.add_argument("--check", action="store_true", help="CPU, small shapes, interpreted fp32, no timing")
    args = ap.parse_args(argv)
    if args.check:
        rows = run_layout("check", "3x37", "cpu", torch.float32, None, False)
        bad = [r for r in rows if float(r["rel_err"]) > 1e-5]
        for r in rows:
            print(r["layout"], r["impl"], "rel_err", r["rel_err"])
        if bad:
            raise SystemExit(f"--check: {len(bad)} implementation(s) off the reference: {bad}")
        return rows
    if not torch.cuda.is_available():
        raise SystemExit("bench_ssd times a GPU: run it where CUDA is available, or pass --check on a CPU")
    tflops, gbs = ceilings(print)  # the kernel benchmark's: bf16 matmul 8192^3, 1 GiB copy (read + write)
    rates = (tflops * 1e12, gbs * 1e9)
    rows = []
    for lay in args.layouts.split(","):
        rows += run_layout(args.model, lay, "cuda", torch.bfloat16, rates, True)
    stamp = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        commit=args.commit,
        gpu=torch.cuda.get_device_name(),
    )
    rows = [stamp | r for r in rows]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ssd.csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=COLUMNS)
            wr.writeheader()
            wr.writerows(rows)
    print(" | ".join(COLUMNS[3:]))
    for r in rows:
        print(" | ".join(str(r[c]) for c in COLUMNS[3:]))
    return rows


if __name__ == "__main__":
    main()
