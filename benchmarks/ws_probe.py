"""Probe: does Triton 3.6's Hopper warp specialisation (tl.range(..., warp_specialize=True), the autoWS pass that
compiler.py runs for sm90) speed up the MoE expert GEMMs' base path?

A minimal grouped GEMM (no LoRA, no bias): rows grouped by expert (moe_align), X gathered by pointer loads or
sorted and loaded by TMA, W by TMA through a host descriptor (E, N_w, K) with blocks (1, BN, BK), gated GEMMs as
two accumulators (gate rows, up rows N further), the epilogue's activation / top-k weight, and the output stored
in place (sorted) or scattered back to its pair's row. Timed with triton.testing.do_bench against the runtime's
own launch (kernels.fused_moe_lora.launch_gemm at its default config) on the same routing, and checked against it.

    python benchmarks/ws_probe.py --compile      # CPU: compile each variant for sm90, report WS / registers / smem
    python benchmarks/ws_probe.py --out DIR      # GPU: time the variants at Qwen3-30B-A3B and gpt-oss-20b shapes
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lpdiff.kernels.fused_moe_lora import _act, default_config, launch_gemm  # noqa: E402
from lpdiff.kernels.moe_align import moe_align  # noqa: E402


@triton.jit
def _ws_gemm(X, W, Out, TopkW, SortedIds, BlockExpert, NumPadded, num_pairs, N,
             stride_xm, stride_om,
             TOPK: tl.constexpr, TMA_X: tl.constexpr, OUT_SORTED: tl.constexpr, GATED: tl.constexpr,
             ACT: tl.constexpr, MUL_TOPK: tl.constexpr, ZERO_PAD: tl.constexpr, WS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
             GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.load(NumPadded) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    if pid < num_m * num_n:  # no early return: the WS pass rejects branches out of the function
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        e = tl.load(BlockExpert + pid_m)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(SortedIds + offs_m)
        row_ok = pair < num_pairs
        xrow = tl.minimum(pair, num_pairs - 1) // TOPK
        offs_k = tl.arange(0, BLOCK_K)
        if not TMA_X:
            x_ptrs = X + xrow[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in tl.range(0, K_TILES, warp_specialize=WS):
            if TMA_X:
                xt = X.load([pid_m * BLOCK_M, k * BLOCK_K])
            elif ZERO_PAD:
                xt = tl.load(x_ptrs + k * BLOCK_K, mask=row_ok[:, None], other=0.0)
            else:
                xt = tl.load(x_ptrs + k * BLOCK_K)
            wt = tl.reshape(W.load([e, pid_n * BLOCK_N, k * BLOCK_K]), (BLOCK_N, BLOCK_K))
            acc = tl.dot(xt, wt.T, acc)
            if GATED:
                wu = tl.reshape(W.load([e, N + pid_n * BLOCK_N, k * BLOCK_K]), (BLOCK_N, BLOCK_K))
                acc_up = tl.dot(xt, wu.T, acc_up)
        if GATED:
            h = _act(acc, acc_up, ACT)
        else:
            h = acc
        if MUL_TOPK:
            h = h * tl.load(TopkW + tl.minimum(pair, num_pairs - 1))[:, None]
        orow = offs_m if OUT_SORTED else pair
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(Out + orow[:, None].to(tl.int64) * stride_om + offs_n[None, :], h.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < N)[None, :])


def launch_ws(x, w, out, routing, *, gated: bool, act: int, x_sorted: bool, out_sorted: bool, topk_w=None,
              ws: bool, bn: int, bk: int = 64, warps: int = 4, stages: int = 4, zero_pad: bool = True,
              tma_x: bool = True, run: bool = True):
    from triton.tools.tensor_descriptor import TensorDescriptor
    E, n_w, kdim = w.shape
    n = n_w // 2 if gated else n_w
    bm = routing.block_m
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, bn, bk])
    use_tma_x = tma_x and x_sorted
    xa = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk]) if use_tma_x else x
    grid = (routing.num_blocks * triton.cdiv(n, bn),)
    args = (xa, wd, out, topk_w if topk_w is not None else routing.sorted_ids, routing.sorted_ids,
            routing.block_expert, routing.num_padded, routing.num_pairs, n, x.stride(0), out.stride(0))
    kw = dict(TOPK=routing.top_k, TMA_X=use_tma_x, OUT_SORTED=out_sorted, GATED=gated, ACT=act,
              MUL_TOPK=topk_w is not None, ZERO_PAD=zero_pad, WS=ws, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
              K_TILES=triton.cdiv(kdim, bk), GROUP_M=4, num_warps=warps, num_stages=stages)
    if run:
        _ws_gemm[grid](*args, **kw)
    return args, kw


SHAPES = {  # name: (H, I, E, top-k, activation id, activation)
    "qwen3-30b-a3b": (2048, 768, 128, 8, 1, "silu"),
    "gpt-oss-20b": (2880, 2880, 32, 4, 2, "swiglu_oai"),
}

# (label, ws, block_n, warps, stages) of each variant; WS runs 4 warps of producer and two consumer warpgroups
VARIANTS = [("ws bn128 s4", True, 128, 4, 4), ("ws bn128 s3", True, 128, 4, 3), ("ws bn256 s3", True, 256, 4, 3),
            ("nows bn128 w8 s4", False, 128, 8, 4), ("nows bn256 w8 s3", False, 256, 8, 3),
            ("ws bn64 s5", True, 64, 4, 5)]


def make(shape: str, T: int, device):
    H, I, E, K, act, act_name = SHAPES[shape]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(T, H, generator=g) * 0.5).to(device, torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(device, torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    tw, ids = logits.softmax(-1).topk(K, dim=-1)
    routing = moe_align(ids.to(device), None, E, 0, 128, impl="triton")
    return x, w1, w2, ids.to(device), tw.to(device).reshape(-1).float(), routing, act, act_name


def compile_report():
    """Compile every variant for sm90 on this CPU machine (meta tensors): WS or not, registers, spills, smem."""
    from types import SimpleNamespace

    from benchmarks.bench_kernels import compile_sm90
    for shape, gemm, (label, ws, bn, warps, stages), tma_x in itertools.product(
            SHAPES, ("gate_up", "down"), VARIANTS, (True, False)):
        H, I, E, K, act, _ = SHAPES[shape]
        M = 4096 * K + E * 128
        dev = "meta"
        from triton.tools.tensor_descriptor import TensorDescriptor
        if gemm == "gate_up":
            x = torch.empty(M if tma_x else 4096, H, device=dev, dtype=torch.bfloat16)
            w = torch.empty(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
            out = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
        else:
            x = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
            w = torch.empty(E, H, I, device=dev, dtype=torch.bfloat16)
            out = torch.empty(4096 * K, H, device=dev, dtype=torch.bfloat16)
        ids = torch.empty(M, device=dev, dtype=torch.int32)
        be = torch.empty(M // 128, device=dev, dtype=torch.int32)
        npad = torch.empty(1, device=dev, dtype=torch.int32)
        tw = torch.empty(4096 * K, device=dev, dtype=torch.float32)
        kdim = w.shape[2]
        wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, bn, 64])
        xa = TensorDescriptor(x, list(x.shape), list(x.stride()), [128, 64]) if tma_x else x
        gated = gemm == "gate_up"
        args = (xa, wd, out, tw, ids, be, npad, 4096 * K, I if gated else H, x.stride(0), out.stride(0))
        kw = dict(TOPK=K, TMA_X=tma_x, OUT_SORTED=gated, GATED=gated, ACT=act, MUL_TOPK=not gated, ZERO_PAD=True,
                  WS=ws, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, K_TILES=triton.cdiv(kdim, 64), GROUP_M=4,
                  num_warps=warps, num_stages=stages)
        try:
            r = compile_sm90(SimpleNamespace(jit=_ws_gemm), args, kw)
            print(f"{shape:14s} {gemm:7s} tma_x={int(tma_x)} {label:18s} ws_op={int(r['warp_specialized'])} "
                  f"regs {r['regs']} spill {r['spill']} smem {r['smem']}", flush=True)
        except Exception as exc:  # noqa: BLE001 — a probe: report what the compiler refused
            print(f"{shape:14s} {gemm:7s} tma_x={int(tma_x)} {label:18s} FAILED {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''}", flush=True)


def bench(out_dir: str, only: str | None = None):
    """only: "shape|gemm|label|tma_x", one variant (a child process of drive()); else the runtime's own
    launches, cuBLAS and the gather, per shape."""
    from triton.testing import do_bench
    dev = torch.device("cuda")
    os.makedirs(out_dir, exist_ok=True)
    logf = open(os.path.join(out_dir, "ws_probe.log"), "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()
    if only is None:
        log(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    T = 4096
    for shape in SHAPES:
        if only is not None and not only.startswith(shape + "|"):
            continue
        x, w1, w2, ids, tw, routing, act, act_name = make(shape, T, dev)
        H, I, E, K = SHAPES[shape][:4]
        P = T * K
        M = routing.sorted_ids.shape[0]
        inter_ref = torch.empty(M, I, dtype=x.dtype, device=dev)
        y_ref = torch.empty(P, H, dtype=x.dtype, device=dev)
        cfg = default_config(P, E, I, H, dev, gated=True)
        cfg = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "padding": "half"})
        cfg2 = default_config(P, E, H, I, dev)
        cfg2 = type(cfg2)(**{**{f: getattr(cfg2, f) for f in cfg2.__slots__}, "padding": "half"})
        ref1 = lambda: launch_gemm(x, w1, inter_ref, routing, cfg, x_sorted=False, out_sorted=True,  # noqa: E731
                                   activation=act_name)
        ref2 = lambda: launch_gemm(inter_ref, w2, y_ref, routing, cfg2, x_sorted=True, out_sorted=False,  # noqa
                                   topk_weights=tw)
        ref1()
        ref2()
        torch.cuda.synchronize()
        fl1, fl2 = 2 * P * H * 2 * I, 2 * P * I * H
        xrow = torch.where(routing.sorted_ids < P, routing.sorted_ids, 0) // K
        x_sorted = torch.empty(M, H, dtype=x.dtype, device=dev)
        gather = lambda: torch.index_select(x, 0, xrow, out=x_sorted)  # noqa: E731
        gather()
        x_sorted[routing.sorted_ids >= P] = 0
        if only is not None:
            return one_variant(only, log, do_bench, x, x_sorted, w1, w2, tw, routing, act, inter_ref, y_ref,
                               fl1, fl2)
        t1, t2 = do_bench(ref1, warmup=50, rep=300), do_bench(ref2, warmup=50, rep=300)
        log(f"{shape} runtime gate_up {cfg}: {t1 * 1e3:.1f} us {fl1 / t1 / 1e9:.0f} TFLOP/s useful")
        log(f"{shape} runtime down    {cfg2}: {t2 * 1e3:.1f} us {fl2 / t2 / 1e9:.0f} TFLOP/s useful")
        # dense cuBLAS at the same useful FLOPs (rows = pairs), the ceiling to compare with
        a = torch.randn(P, H, device=dev, dtype=x.dtype)
        b = torch.randn(2 * I, H, device=dev, dtype=x.dtype)
        td = do_bench(lambda: a @ b.T, warmup=50, rep=300)
        log(f"{shape} cuBLAS dense ({P}x{H})x({H}x{2 * I}): {td * 1e3:.1f} us {fl1 / td / 1e9:.0f} TFLOP/s")
        a2, b2 = a[:, :I].contiguous(), torch.randn(H, I, device=dev, dtype=x.dtype)
        td2 = do_bench(lambda: a2 @ b2.T, warmup=50, rep=300)
        log(f"{shape} cuBLAS dense ({P}x{I})x({I}x{H}): {td2 * 1e3:.1f} us {fl2 / td2 / 1e9:.0f} TFLOP/s")
        tg = do_bench(gather, warmup=50, rep=300)
        log(f"{shape} gather x -> ({M}, {H}) sorted rows (torch index_select): {tg * 1e3:.1f} us")


def one_variant(only, log, do_bench, x, x_sorted, w1, w2, tw, routing, act, inter_ref, y_ref, fl1, fl2):
    shape, gemm, label, tma_x = only.split("|")
    tma_x = tma_x == "1"
    _, ws, bn, warps, stages = next(v for v in VARIANTS if v[0] == label)
    P = routing.num_pairs
    name = f"{shape} {gemm:7s} {label:18s} tma_x={int(tma_x)}"
    if gemm == "gate_up":
        out = torch.empty_like(inter_ref)
        xin = x_sorted if tma_x else x
        f = lambda: launch_ws(xin, w1, out, routing, gated=True, act=act, x_sorted=tma_x,  # noqa: E731
                              out_sorted=True, ws=ws, bn=bn, warps=warps, stages=stages)
        used = routing.sorted_ids < P
        check = lambda: (out[used].float() - inter_ref[used].float()).abs().max().item()  # noqa: E731
        fl = fl1
    else:
        out = torch.empty_like(y_ref)
        f = lambda: launch_ws(inter_ref, w2, out, routing, gated=False, act=0, x_sorted=True,  # noqa: E731
                              out_sorted=False, topk_w=tw, ws=ws, bn=bn, warps=warps, stages=stages,
                              tma_x=tma_x)
        check = lambda: (out.float() - y_ref.float()).abs().max().item()  # noqa: E731
        fl = fl2
    f()
    torch.cuda.synchronize()
    err = check()
    t = do_bench(f, warmup=50, rep=300)
    log(f"{name}: {t * 1e3:.1f} us {fl / t / 1e9:.0f} TFLOP/s useful, max |d| vs runtime {err:.2e}")


def drive(out_dir: str, shapes, timeout_s: int):
    """Each variant in a child process with a time limit: a WS kernel that deadlocks or a compile that hangs costs
    one variant, not the run."""
    bench(out_dir)
    for shape, (label, ws, bn, *_), (gemm, tma_x) in itertools.product(
            shapes, VARIANTS, (("down", 1), ("gate_up", 1), ("down", 0), ("gate_up", 0))):
        if (gemm == "gate_up" and bn > 128) or (ws and not tma_x):
            continue  # spills / the WS pass rejects gathered pointer loads (--compile)
        only = f"{shape}|{gemm}|{label}|{tma_x}"
        try:
            r = subprocess.run([sys.executable, __file__, "--out", out_dir, "--one", only], timeout=timeout_s,
                               capture_output=True, text=True)
            if r.returncode:
                tail = [ln for ln in r.stderr.splitlines() if "Error" in ln or "Assertion" in ln][-2:]
                print(f"{only}: rc {r.returncode} {tail}", flush=True)
                with open(os.path.join(out_dir, "ws_probe.log"), "a") as f:
                    f.write(f"{only}: FAILED rc {r.returncode} {tail}\n")
        except subprocess.TimeoutExpired:
            print(f"{only}: TIMEOUT after {timeout_s} s", flush=True)
            with open(os.path.join(out_dir, "ws_probe.log"), "a") as f:
                f.write(f"{only}: TIMEOUT after {timeout_s} s (hang)\n")

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/run")
    ap.add_argument("--one", help="shape|gemm|label|tma_x: one variant in this process")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--timeout-s", type=int, default=60)
    args = ap.parse_args()
    if args.compile:
        compile_report()
    elif args.one:
        bench(args.out, args.one)
    else:
        drive(args.out, args.shapes, args.timeout_s)
