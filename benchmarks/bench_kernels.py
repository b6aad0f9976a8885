"""Benchmark of the fused MoE-LoRA kernels (row "triton_fused_lora": each GEMM's shrink precomputed once per row
block, lora_shrink="once", the default ("auto"); "triton_fused_shrink_in_k_loop": the shrink inside every N tile's
K-loop;
"*_ntilesK": each GEMM program walks K N tiles of its row block, GemmConfig(n_tiles=K), with the shrink inside the
first tile's K-loop only (triton_fused_lora_ntilesK), the shrink precomputed (triton_fused_lora_once_ntilesK) or no
LoRA (triton_no_lora_ntilesK), each checked against the default row's output; "*_epilogue_loads": the GEMM
epilogue's operands loaded after the K-loop, GemmConfig(prefetch=False), the old order; "*_tma": expert weight
tiles, and the down GEMM's sorted rows, by TMA, GemmConfig(tma=True)) against the same kernels without LoRA, the
grouped_mm backend
(kernels/moe_grouped.py: CUTLASS bases + Triton LoRA passes, with its per-stage times), torch grouped_mm + unfused
LoRA and transformers' grouped_mm experts forward, at Qwen3-30B-A3B and gpt-oss-20b expert shapes; and the dense
LoRA linear (lora_linear: cuBLAS base + in-place Triton LoRA, the fused Triton kernel, cuBLAS + torch LoRA, and the
bases alone) at the Qwen3-30B-A3B q|k|v and o projection shapes.

    python -m benchmarks.bench_kernels --out DIR [--commit SHA] [--quick]
    python -m benchmarks.bench_kernels --check   # CPU: the baselines against the reference, no timing
    python -m benchmarks.bench_kernels --out DIR --quick --dense-only   # lora_linear rows only
    python -m benchmarks.bench_kernels --out DIR --quick --moe-only     # MoE rows only (both backends)
    python -m benchmarks.bench_kernels --out DIR --sweep [--sweep-shape S]   # only: moe_forward_triton over tiles
    python -m benchmarks.bench_kernels --out DIR --sweep-shrink   # only: the LoRA shrink launch over a grid
    python -m benchmarks.bench_kernels --compile-sm90   # CPU: the MoE launches compiled for sm90 (smem, regs, TMA)
    python -m benchmarks.bench_kernels --out DIR --router-only   # only: Nemotron-H's fp32 router GEMM, side by side

Writes DIR/kernels.csv (date,commit,gpu,benchmark,shape,T,adapters,dtype,impl,ms,tflops,pct_roofline) and
DIR/bench.log; prints a table last. Roofline: time = max(FLOPs / measured bf16 matmul rate, bytes / measured copy
bandwidth) where bytes = expert weights (+ LoRA weights) read once + x read + out written; pct_roofline =
roofline time / measured time.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from lpdiff.kernels import moe_grouped as mg
from lpdiff.kernels.activation import activate
from lpdiff.kernels.fused_moe_lora import moe_configs, moe_forward_triton, shrink_once
from lpdiff.kernels.gemm_config import GemmConfig
from lpdiff.kernels.lora_linear import base_linear, lora_linear, pack_lora_b
from lpdiff.kernels.moe import moe_forward
from lpdiff.kernels.moe_inputs import MoeInputs
from tests.helpers.moe_bench import (
    SHAPES,
    SM90_FLAG_SETS,
    MoeShape,
    bench,
    configs,
    make_inputs,
    rel_err,
    shrink_label,
    shrink_sweep,
    sm90_report,
    stage_breakdown,
    untimed,
)

COLUMNS = [
    "date",
    "commit",
    "gpu",
    "benchmark",
    "shape",
    "T",
    "adapters",
    "dtype",
    "impl",
    "ms",
    "tflops",
    "pct_roofline",
]


# ---------------------------------------------------------------------------------------------------- baselines


def grouped_mm(x, w, offs):
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


def _group(keys: torch.Tensor, num_groups: int):
    order = torch.sort(keys, stable=True).indices
    counts = torch.zeros(num_groups, dtype=torch.int32, device=keys.device).scatter_add_(
        0, keys, torch.ones_like(keys, dtype=torch.int32)
    )
    return order, counts.cumsum(0, dtype=torch.int32)


def torch_grouped_lora(moe: MoeInputs) -> torch.Tensor:
    """torch grouped_mm for the base GEMMs plus unfused LoRA (grouped_mm shrink and expand per (slot, expert)
    group), in the pair order of the base GEMMs: what an engine gets without a fused kernel."""
    x, lora = moe.x, moe.lora
    T, H = x.shape
    E, K = moe.w_gate_up.shape[0], moe.topk_ids.shape[1]
    ids = moe.topk_ids.reshape(-1).long()
    order, offs = _group(ids, E)
    tok = order // K
    xs = x[tok]
    h = grouped_mm(xs, moe.w_gate_up.transpose(1, 2), offs)
    if moe.b_gate_up is not None:
        h += moe.b_gate_up[ids[order]]
    if lora is not None:
        L, _, R, _ = lora.gate_up_a.shape
        slot = moe.token_adapter.long()[tok]
        # pairs sorted by expert; LoRA groups by (slot, expert) inside that order (one slot: the same order)
        lorder, loffs = _group(slot * E + ids[order], L * E)
        xl = xs[lorder]
        scale = lora.scaling[slot[lorder]].to(x.dtype)[:, None]
        sa = grouped_mm(xl, lora.gate_up_a.reshape(L * E, R, H).transpose(1, 2), loffs) * scale
        h.index_add_(0, lorder, grouped_mm(sa, lora.gate_up_b.reshape(L * E, -1, R).transpose(1, 2), loffs))
    act = activate(h, moe.activation)
    y = grouped_mm(act, moe.w_down.transpose(1, 2), offs)
    if moe.b_down is not None:
        y += moe.b_down[ids[order]]
    if lora is not None:
        sd = grouped_mm(act[lorder], lora.down_a.reshape(L * E, R, -1).transpose(1, 2), loffs) * scale
        y.index_add_(0, lorder, grouped_mm(sd, lora.down_b.reshape(L * E, H, R).transpose(1, 2), loffs))
    y = y * moe.topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def hf_experts(s: MoeShape, p: MoeInputs):
    """transformers' own experts module with experts_implementation="grouped_mm", weights in HF layout."""
    if s.name.startswith("qwen3"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(hidden_size=s.H, moe_intermediate_size=s.I, num_experts=s.E, num_experts_per_tok=s.K)
        cfg._experts_implementation = "grouped_mm"
        m = Qwen3MoeExperts(cfg)
        m.gate_up_proj.data, m.down_proj.data = p.w_gate_up, p.w_down
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(hidden_size=s.H, intermediate_size=s.I, num_local_experts=s.E, num_experts_per_tok=s.K)
        cfg._experts_implementation = "grouped_mm"
        m = GptOssExperts(cfg)
        gu, bgu = p.w_gate_up, p.b_gate_up  # kernel layout (gate rows then up rows) -> HF interleaved
        m.gate_up_proj.data = torch.stack([gu[:, : s.I], gu[:, s.I :]], 2).reshape(s.E, s.n1, s.H).transpose(1, 2)
        m.gate_up_proj_bias.data = torch.stack([bgu[:, : s.I], bgu[:, s.I :]], 2).reshape(s.E, s.n1)
        m.down_proj.data = p.w_down.transpose(1, 2)
        m.down_proj_bias.data = p.b_down
    return lambda: m(p.x, p.topk_ids.long(), p.topk_weights.to(p.x.dtype))


# ------------------------------------------------------------------------------------------------------ counting


def moe_flops(s: MoeShape, T: int, rank: int, lora: bool) -> float:
    pairs = T * s.K
    f = 2 * pairs * (s.H * s.n1 + s.I * s.H)
    if lora:
        f += 2 * pairs * rank * (s.H + s.n1 + s.I + s.H)
    return f


def moe_bytes(s: MoeShape, T: int, rank: int, L: int, elem=2) -> float:
    b = s.E * (s.n1 * s.H + s.H * s.I) * elem + 2 * T * s.H * elem
    b += L * s.E * rank * (s.H + s.n1 + s.I + s.H) * elem
    return b


DENSE_SHAPES = [("qkv", 2048, (4096, 512, 512)), ("o", 4096, (2048,))]  # (name, input width, output slices)


def dense_inputs(T: int, L: int, H: int, widths: tuple, rank: int, dtype, device, seed=0) -> dict:
    """lora_linear's arguments; contiguous runs of tokens per adapter, as prompts of a batch would be."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale

    N = sum(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    return dict(
        x=rnd(T, H),
        w=rnd(N, H, scale=H**-0.5),
        bias=None,
        lora_a=rnd(L, len(widths), rank, H, scale=H**-0.5),
        lora_b=rnd(L, N, rank, scale=0.02),
        scaling=torch.full((L,), 2.0, device=device),
        slice_offsets=tuple(offs),
        token_adapter=(torch.arange(T, device=device) * L // T).to(torch.int32),
    )


def dense_unfused(x, w, bias, lora_a, lora_b, scaling, slice_offsets, token_adapter):
    """Vendor GEMM + per-(adapter, slice) torch LoRA: what an engine gets without a LoRA kernel. Rows of adapter a
    are the contiguous run dense_inputs gives it (no host sync to find them)."""
    T, L = x.shape[0], lora_a.shape[0]
    out = F.linear(x, w, bias)
    for a in range(L):
        rows = slice(-(-a * T // L), -(-(a + 1) * T // L))
        for si, (lo, hi) in enumerate(itertools.pairwise(slice_offsets)):
            out[rows, lo:hi] += (x[rows] @ lora_a[a, si].T * scaling[a].to(x.dtype)) @ lora_b[a, lo:hi].T
    return out


def dense_impls(p: dict, impl: str = "triton") -> dict:
    """The dense LoRA paths timed (and checked) against each other, by row label."""
    packed = pack_lora_b(p["lora_b"], p["scaling"], p["slice_offsets"])  # built once per layer by the engine
    return {
        "triton_cublas+lora": lambda: lora_linear(**p, impl=impl, b_packed=packed),
        "triton_delta_lora": lambda: lora_linear(**p, impl=impl, path="triton_delta"),
        "triton_fused_lora": lambda: lora_linear(**p, impl=impl, fused=True),
        "cublas+unfused_lora": lambda: dense_unfused(**p),
    }


def ceilings(log) -> tuple[float, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    tflops = 2 * 8192**3 / ms / 1e9
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms_c = bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 2 / ms_c / 1e6  # GB/s, read + write
    log(f"ceilings: bf16 matmul 8192^3 {tflops:.0f} TFLOP/s ({ms:.3f} ms); copy 1 GiB {bw:.0f} GB/s (r+w)")
    return tflops, bw


# ------------------------------------------------------------------------------------------------------- drivers

# programs walking several N tiles (GemmConfig.n_tiles): (row label, lora_shrink, n_tiles) of the LoRA rows
NTILE_ROWS = [
    ("triton_fused_lora_ntiles2", "fused", 2),
    ("triton_fused_lora_ntiles3", "fused", 3),
    ("triton_fused_lora_ntiles4", "fused", 4),
    ("triton_fused_lora_once_ntiles2", "once", 2),
]
NO_LORA_NTILES = 2  # the base path's row triton_no_lora_ntiles2: the same K-loops, so bit-identical to the default


def ntile_run(p, lora_shrink: str, n_tiles: int):
    """moe_forward_triton with the default tiles of lora_shrink's mode, both GEMMs walking n_tiles N tiles."""
    return lambda: moe_forward_triton(p, **configs(p, lora_shrink, n_tiles=n_tiles), lora_shrink=lora_shrink)


def grouped_stages(p, rep=50) -> dict:
    """Times each step of moe_forward_grouped alone (same inputs, same order). The key in parentheses is not a
    step: gate_up's grouped GEMM on a contiguous (E, H, N1) copy of the weights, against the transposed view of
    the nn.Linear layout that the backend passes (no copy)."""
    x, lora, ids = p.x, p.lora, p.topk_ids
    E, n1, _ = p.w_gate_up.shape
    K = ids.shape[1]
    t = {"sort": bench(lambda: mg.sort_by_expert(ids, E), rep)}
    row_pair, row_expert, offs = mg.sort_by_expert(ids, E)
    t["gather"] = bench(lambda: x[row_pair // K], rep)
    tok = row_pair // K
    xg = x[tok]
    t["gemm1"] = bench(lambda: mg.grouped_gemm(xg, p.w_gate_up, offs), rep)
    wt = p.w_gate_up.transpose(1, 2).contiguous()
    t["(gemm1, (E,H,N1) copy)"] = bench(lambda wt=wt: mg._GROUPED_MM(xg, wt, offs=offs), rep)
    del wt
    h = mg.grouped_gemm(xg, p.w_gate_up, offs)
    if lora is not None:  # the in-place deltas add up over the repetitions: the values are not looked at
        slot = p.token_adapter[tok]
        t["plan_lora"] = bench(lambda: mg.plan_lora(row_expert, slot, lora, E, (n1, x.shape[1])), rep)
        blocks, cfg1, cfg2 = mg.plan_lora(row_expert, slot, lora, E, (n1, x.shape[1]))
        t["delta1"] = bench(
            lambda: mg.add_lora_delta(h, xg, lora.gate_up_a, lora.gate_up_b, lora, blocks, p.w_gate_up, cfg1), rep
        )
    t["bias_act"] = bench(lambda: mg.bias_act(h, row_expert, p.b_gate_up, p.activation), rep)
    act = mg.bias_act(h, row_expert, p.b_gate_up, p.activation)
    t["gemm2"] = bench(lambda: mg.grouped_gemm(act, p.w_down, offs), rep)
    y = mg.grouped_gemm(act, p.w_down, offs)
    if lora is not None:
        t["delta2"] = bench(
            lambda: mg.add_lora_delta(y, act, lora.down_a, lora.down_b, lora, blocks, p.w_down, cfg2), rep
        )
    row_of = torch.empty_like(row_pair)
    row_of[row_pair] = torch.arange(row_pair.shape[0], dtype=row_pair.dtype, device=x.device)
    t["topk_sum"] = bench(lambda: mg.topk_sum(y, row_of, ids, p.topk_weights, p.b_down), rep)
    return t


def stages_line(t: dict) -> str:
    return (
        ", ".join(f"{k} {v:.4f}" for k, v in t.items())
        + f" | sum {sum(v for k, v in t.items() if not k.startswith('(')):.4f} ms"
    )


def sweep_pairs(
    gated: bool = True, base: tuple[GemmConfig, GemmConfig] | None = None
) -> list[tuple[GemmConfig, GemmConfig]]:
    """24 tile configs of moe_forward_triton (gate_up, down): block_m x dot width x block_k x (warps, stages), each
    with pointer loads and then with TMA weight tiles (GemmConfig.tma). The dot is 256 or 128 wide: block_n counts
    output columns, so a gated gate_up's (two block_n halves, two block_n dots under TMA) takes block_n 128 / 64 and
    a non-gated up's (relu², Nemotron-H) 256 / 128; the down GEMM gets the same dot width and block_m (both GEMMs
    share one alignment). base: the (gate_up, down) configs whose other fields (padding, n_tail, expand, ...) every
    swept config keeps; tile_sweep passes the defaults', so configs differ from the default in their tiles only (at
    Super's shape, swept at padding "compute" against the default's "half", every config ran 25-192 % behind it,
    kernels.md). None: GemmConfig's own fields."""
    b1, b2 = base or (GemmConfig(64, 64, 64), GemmConfig(64, 64, 64))
    pairs = []
    widths = (128, 64) if gated else (256, 128)
    for bm, bn, bk, (warps, stages), tma in itertools.product(
        (128, 64), widths, (64, 32), ((8, 4), (8, 3), (4, 3)), (False, True)
    ):
        tiles = dict(block_m=bm, block_k=bk, group_m=4, num_warps=warps, num_stages=stages, tma=tma)
        pairs.append((replace(b1, block_n=bn, **tiles), replace(b2, block_n=2 * bn if gated else bn, **tiles)))
    return pairs


# the tile sweep's shapes: SHAPES, then Nemotron-H's routed experts (Nano; Super's in its 1024-wide latent dim)
SWEEP_SHAPES = {
    s.name: s
    for s in (
        *SHAPES,
        MoeShape("nemotron-3-nano", 128, 2688, 1856, 6, "relu2", False),
        MoeShape("nemotron-3-super-latent", 512, 1024, 2688, 22, "relu2", False),
    )
}


def tile_sweep(
    log, record_row, R: int, budget_s: float, shape: MoeShape = SHAPES[0], T: int = 4096, device: str = "cuda"
) -> None:
    """moe_forward_triton over sweep_pairs() at one expert shape, T tokens, one adapter and none, after the
    default config's time, each config's output checked against the default's; stops starting configs after
    budget_s (each new config compiles four kernels). Best five of each (with and without TMA apart) printed last.
    device "cpu": the interpreter (a rehearsal)."""
    s = shape
    timer = bench if device == "cuda" else untimed
    p = make_inputs(s, T, 1, R, torch.bfloat16, device)
    base = p.without_lora()
    ref = {}
    for name, q in (("lora", p), ("no_lora", base)):
        ref[name] = moe_forward_triton(q)
        ms = timer(lambda q=q: moe_forward_triton(q))
        log(f"sweep {s.name} default {name}: {ms:.4f} ms")
        record_row(name, "default", "default", ms)
    t0, results = time.time(), {"lora": [], "no_lora": [], "lora_tma": [], "no_lora_tma": []}
    gated = s.activation != "relu2"
    defaults = {name: moe_configs(q, shrink_once(q.lora, "auto")) for name, q in (("lora", p), ("no_lora", base))}
    for tiles in zip(*(sweep_pairs(gated, defaults[name]) for name in ("lora", "no_lora")), strict=True):
        if time.time() - t0 > budget_s:
            log(f"sweep: budget {budget_s:.0f} s spent, configs from c1={tiles[0][0]} on not tried")
            break
        for (name, q), (c1, c2) in zip((("lora", p), ("no_lora", base)), tiles, strict=True):
            try:
                err = rel_err(moe_forward_triton(q, config=c1, down_config=c2), ref[name])
                ms = timer(lambda q=q, c1=c1, c2=c2: moe_forward_triton(q, config=c1, down_config=c2))
            except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit must not end the run)
                log(f"sweep {name} c1={c1} c2={c2} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if err > 1e-2:  # another tiling sums in another order (bf16 output); a wrong result is far off
                log(f"sweep {name} c1={c1} c2={c2} MISMATCH: rel err {err:.2e} against the default; not ranked")
                continue
            results[name + ("_tma" if c1.tma else "")].append((ms, c1, c2))
            record_row(name, c1, c2, ms)
    for name, res in results.items():
        for ms, c1, c2 in sorted(res, key=lambda r: r[0])[:5]:
            log(f"sweep best {s.name} {name}: {ms:.4f} ms c1={c1} c2={c2}")


# Nemotron-H's fp32 routers at 4096 tokens (T, E, H): Nano, Super
ROUTER_SHAPES = [("nano", 4096, 128, 2688), ("super", 4096, 512, 4096)]


def router_rows(log, record) -> None:
    """The fp32 router GEMM (kernels/fp32_sums_gemm.py) beside its peers: the IEEE fp32 GEMM transformers runs
    (cuBLAS, tf32 off), cuBLAS's bf16 GEMM with fp32 output (tensor-core accumulation: the floor's rate, not the
    reference's sums) and the kernel at a few tilings. Each row's error against the exact (fp64) sums is logged
    next to the IEEE GEMM's: the kernel must stay near it, the tensor-core accumulation does not."""
    from benchmarks.sol_hybrid import tensor_core_fp32_out
    from lpdiff.kernels.fp32_sums_gemm import fp32_sums_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, T, E, H in ROUTER_SHAPES:
        x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
        w = (0.02 * torch.randn(E, H, generator=g, device="cuda")).to(torch.bfloat16)
        exact = x.double() @ w.double().t()
        impls = {
            "ieee_fp32 (cuBLAS)": lambda x=x, w=w: F.linear(x.float(), w.float()),
            "bf16_fp32out (cuBLAS)": lambda x=x, w=w: tensor_core_fp32_out(x, w),
        }
        for bm, bk, nw in ((128, 64, 8), (128, 32, 8), (64, 64, 4), (64, 32, 4)):
            cfg = dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=nw)
            impls[f"fp32_sums bm{bm} bk{bk} w{nw}"] = lambda x=x, w=w, cfg=cfg: fp32_sums_gemm(x, w, config=cfg)
        flops, nbytes = 2 * T * E * H, 2 * (T * H + E * H) + 4 * T * E
        for impl, fn in impls.items():
            err = (fn().double() - exact).abs().max().item()
            record("router", f"{name} T{T} E{E} H{H} (err {err:.2e})", T, 0, impl, bench(fn), flops, nbytes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/run")
    ap.add_argument("--commit", default=os.environ.get("LPDIFF_COMMIT", "unknown"))
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="only: moe_forward_triton over a grid of tile configs at T=4096 (sweep_pairs), --sweep-shape's shape",
    )
    ap.add_argument("--sweep-shape", choices=sorted(SWEEP_SHAPES), default=SHAPES[0].name)
    ap.add_argument("--sweep-budget-s", type=float, default=200.0, help="start no sweep config after this")
    ap.add_argument(
        "--sweep-shrink",
        action="store_true",
        help="only: the LoRA shrink launch (ShrinkConfig) over a grid, Qwen3 and gpt-oss, T=4096",
    )
    ap.add_argument("--quick", action="store_true", help="T=4096 only")
    ap.add_argument("--check", action="store_true", help="CPU: baselines vs reference at small shapes, no timing")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dense-only", action="store_true", help="only the dense lora_linear rows (no MoE layers)")
    ap.add_argument("--moe-only", action="store_true", help="only the MoE layer rows (no dense lora_linear)")
    ap.add_argument("--router-only", action="store_true", help="only the fp32 router GEMM rows (Nemotron-H)")
    ap.add_argument(
        "--compile-sm90",
        action="store_true",
        help="CPU, no GPU: compile the MoE launches for sm90 at both shapes (default, prefetch off, TMA) "
        "and print shared memory, registers, spills and TMA use",
    )
    args = ap.parse_args()
    if args.check:
        check_baselines()
        return
    if args.compile_sm90:
        sm90_report(print, SHAPES, 4096, args.rank, SM90_FLAG_SETS)
        return
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "bench.log"), "a")  # noqa: SIM115 (appended to for the whole run, closed at exit)

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    path = os.path.join(args.out, "kernels.csv")
    new = not os.path.exists(path)
    csvf = open(path, "a", newline="")  # noqa: SIM115 (closed on each of main's three ways out)
    wr = csv.DictWriter(csvf, fieldnames=COLUMNS)
    if new:
        wr.writeheader()

    class Rows(list):  # each row reaches the file at once, so a run cut short keeps what it measured
        def append(self, r):
            super().append(r)
            wr.writerow({c: r.get(c, "") for c in COLUMNS} | dict(date=date, commit=args.commit, gpu=gpu))
            csvf.flush()

    rows = Rows()
    R = args.rank
    if args.sweep_shrink:

        def shrink_row(s, gemm, cfg, ms, err):
            flops = 2 * 4096 * s.K * R * (s.H if gemm == "gate_up" else s.I)
            rows.append(
                dict(
                    benchmark="shrink_sweep",
                    shape=s.label(R),
                    T=4096,
                    adapters=1,
                    dtype="bf16",
                    impl=f"{gemm} {shrink_label(cfg)}",
                    ms=f"{ms:.4f}",
                    tflops=f"{flops / ms / 1e9:.1f}",
                )
            )
            log(
                f"shrink {s.name:14s} {gemm:7s} {shrink_label(cfg):34s} {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s"
                f" rel err vs default {err:.1e}" + ("  MISMATCH" if err > 1e-3 else "")
            )

        shrink_sweep(log, shrink_row, SHAPES, 4096, R, args.sweep_budget_s)
        csvf.close()
        log(f"wrote {len(rows)} rows to {path}")
        return
    peak, bw = ceilings(log)
    rows.append(dict(benchmark="ceiling", shape="bf16 matmul 8192^3", impl="torch.matmul", tflops=f"{peak:.1f}"))
    rows.append(dict(benchmark="ceiling", shape=f"copy 1GiB: {bw:.0f} GB/s (read+write)", impl="Tensor.copy_"))

    def record(bm, shape_label, T, L, impl, ms, flops, nbytes):
        floor = max(flops / (peak * 1e12), nbytes / (bw * 1e9)) * 1e3
        row = dict(
            benchmark=bm,
            shape=shape_label,
            T=T,
            adapters=L,
            dtype="bf16",
            impl=impl,
            ms=f"{ms:.4f}",
            tflops=f"{flops / ms / 1e9:.1f}",
            pct_roofline=f"{100 * floor / ms:.1f}",
        )
        rows.append(row)
        log(
            f"{bm:10s} {shape_label:40s} T={T:6d} L={L} {impl:34s} {ms:8.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s "
            f"{100 * floor / ms:5.1f}% roofline (floor {floor:.3f} ms)"
        )

    if args.router_only:
        router_rows(log, record)
        csvf.close()
        log(f"wrote {len(rows)} rows to {path}")
        return

    if args.sweep:

        def sweep_row(name, c1, c2, ms):
            rows.append(
                dict(
                    benchmark="moe_sweep",
                    shape=SWEEP_SHAPES[args.sweep_shape].label(R),
                    T=4096,
                    adapters=int(name == "lora"),
                    dtype="bf16",
                    impl=f"c1={c1} c2={c2}",
                    ms=f"{ms:.4f}",
                )
            )
            log(f"sweep {name:7s} {ms:8.4f} ms c1={c1} c2={c2}")

        tile_sweep(log, sweep_row, R, args.sweep_budget_s, SWEEP_SHAPES[args.sweep_shape])
        csvf.close()
        log(f"wrote {len(rows)} rows to {path}")
        return

    moe_shapes = [] if args.dense_only else SHAPES
    no_tma = set()  # shapes whose TMA variant failed its check: no TMA rows for them
    # correctness at the benchmark shapes before timing them
    for s in moe_shapes:
        p = make_inputs(s, 1024, 2, R, torch.bfloat16, "cuda", seed=1)
        ref = moe_forward(p, impl="torch")
        err = rel_err(moe_forward(p, impl="triton"), ref)
        err_k = rel_err(moe_forward(p, impl="triton", lora_shrink="fused"), ref)
        try:
            err_tma = f"{rel_err(moe_forward_triton(p, **configs(p, tma=True)), ref):.2e}"
        except Exception as exc:  # noqa: BLE001 (exploratory: a TMA failure on this GPU must not cost the other rows)
            err_tma = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            no_tma.add(s.name)
        err_g = rel_err(moe_forward(p, impl="triton", backend="grouped_mm"), ref)
        err_t = rel_err(torch_grouped_lora(p), ref)
        err_n = ", ".join(
            f"{name[len('triton_fused_lora_') :]} {rel_err(ntile_run(p, mode, k)(), ref):.2e}"
            for name, mode, k in NTILE_ROWS
        )
        log(
            f"check {s.name} T=1024 L=2 bf16: triton rel err {err:.2e} (shrink in the K-loop {err_k:.2e}, "
            f"TMA weight tiles {err_tma}, {err_n}), "
            f"grouped_mm backend rel err {err_g:.2e}, "
            f"torch grouped_mm+LoRA rel err {err_t:.2e}"
        )
        why = mg.grouped_mm_unsupported(p)
        if why is not None:
            log(
                f"WARNING {s.name}: the grouped_mm backend falls back to the fused kernel here ({why}); its rows "
                "are labelled grouped_mm(fallback)"
            )

    Ts = (4096,) if args.quick else (512, 4096, 32768)
    for s in moe_shapes:
        for T in Ts:
            for L in (1, 4):
                p = make_inputs(s, T, L, R, torch.bfloat16, "cuda")
                lab = s.label(R)
                fl, fb = moe_flops(s, T, R, True), moe_bytes(s, T, R, L)
                record(
                    "moe_layer",
                    lab,
                    T,
                    L,
                    "triton_fused_lora",
                    bench(lambda p=p: moe_forward_triton(p, lora_shrink="once")),
                    fl,
                    fb,
                )
                record(
                    "moe_layer",
                    lab,
                    T,
                    L,
                    "triton_fused_lora_epilogue_loads",
                    bench(lambda p=p: moe_forward_triton(p, **configs(p, prefetch=False))),
                    fl,
                    fb,
                )
                if s.name not in no_tma:
                    record(
                        "moe_layer",
                        lab,
                        T,
                        L,
                        "triton_fused_lora_tma",
                        bench(lambda p=p: moe_forward_triton(p, **configs(p, tma=True))),
                        fl,
                        fb,
                    )
                record(
                    "moe_layer",
                    lab,
                    T,
                    L,
                    "triton_fused_shrink_in_k_loop",
                    bench(lambda p=p: moe_forward_triton(p, lora_shrink="fused")),
                    fl,
                    fb,
                )
                default_out = moe_forward_triton(p, lora_shrink="once")
                for name, mode, k in NTILE_ROWS:
                    fn = ntile_run(p, mode, k)
                    log(
                        f"check {name} {s.name} T={T} L={L}: rel err vs triton_fused_lora "
                        f"{rel_err(fn(), default_out):.2e}"
                    )
                    record("moe_layer", lab, T, L, name, bench(fn), fl, fb)
                del default_out
                gname = "grouped_mm" if mg.grouped_mm_unsupported(p) is None else "grouped_mm(fallback)"
                record(
                    "moe_layer",
                    lab,
                    T,
                    L,
                    f"{gname}+triton_lora",
                    bench(lambda p=p: moe_forward(p, backend="grouped_mm")),
                    fl,
                    fb,
                )
                record(
                    "moe_layer",
                    lab,
                    T,
                    L,
                    "torch_grouped_mm+unfused_lora",
                    bench(lambda p=p: torch_grouped_lora(p)),
                    fl,
                    fb,
                )
                if L == 1:
                    base = p.without_lora()
                    fl0, fb0 = moe_flops(s, T, R, False), moe_bytes(s, T, R, 0)
                    record(
                        "moe_layer",
                        lab,
                        T,
                        0,
                        "triton_no_lora",
                        bench(lambda base=base: moe_forward_triton(base)),
                        fl0,
                        fb0,
                    )
                    record(
                        "moe_layer",
                        lab,
                        T,
                        0,
                        "triton_no_lora_epilogue_loads",
                        bench(lambda base=base: moe_forward_triton(base, **configs(base, prefetch=False))),
                        fl0,
                        fb0,
                    )
                    if s.name not in no_tma:
                        record(
                            "moe_layer",
                            lab,
                            T,
                            0,
                            "triton_no_lora_tma",
                            bench(lambda base=base: moe_forward_triton(base, **configs(base, tma=True))),
                            fl0,
                            fb0,
                        )
                    fn = ntile_run(base, "once", NO_LORA_NTILES)
                    same = torch.equal(fn(), moe_forward_triton(base))
                    log(
                        f"check triton_no_lora_ntiles{NO_LORA_NTILES} {s.name} T={T}: bit-identical to "
                        f"triton_no_lora: {same}" + ("" if same else "  MISMATCH")
                    )
                    record("moe_layer", lab, T, 0, f"triton_no_lora_ntiles{NO_LORA_NTILES}", bench(fn), fl0, fb0)
                    record(
                        "moe_layer",
                        lab,
                        T,
                        0,
                        f"{gname}_no_lora",
                        bench(lambda base=base: moe_forward(base, backend="grouped_mm")),
                        fl0,
                        fb0,
                    )
                    record(
                        "moe_layer",
                        lab,
                        T,
                        0,
                        "torch_grouped_mm",
                        bench(lambda base=base: torch_grouped_lora(base)),
                        fl0,
                        fb0,
                    )
                    record("moe_layer", lab, T, 0, "hf_experts_grouped_mm", bench(hf_experts(s, base)), fl0, fb0)
                    if T == 4096:
                        for name, q, mode, flags in (
                            ("lora", p, "once", {}),
                            ("lora epilogue_loads", p, "once", dict(prefetch=False)),
                            ("lora tma", p, "once", dict(tma=True)),
                            ("lora shrink_in_k_loop", p, "fused", {}),
                            *(
                                (f"lora {'shrink_in_k_loop ' if m == 'fused' else ''}ntiles{k}", p, m, dict(n_tiles=k))
                                for _, m, k in NTILE_ROWS
                            ),
                            ("no_lora", base, "once", {}),
                            ("no_lora epilogue_loads", base, "once", dict(prefetch=False)),
                            ("no_lora tma", base, "once", dict(tma=True)),
                        ):
                            if flags.get("tma") and s.name in no_tma:
                                continue
                            log(f"stages {s.name} T={T} {name}: " + stages_line(stage_breakdown(q, mode, **flags)[0]))
                        for name, q in (("lora", p), ("no_lora", base)):
                            log(f"grouped_mm stages {s.name} T={T} {name}: " + stages_line(grouped_stages(q)))
                del p
                torch.cuda.empty_cache()

    # dense LoRA at the Qwen3-30B-A3B q|k|v and o shapes
    for (name, H, widths), T, L in itertools.product([] if args.moe_only else DENSE_SHAPES, Ts, (1, 4)):
        N = sum(widths)
        lab = f"qwen3-30b-a3b {name}(H{H},N{N},S{len(widths)},r{R})"
        p = dense_inputs(T, L, H, widths, R, torch.bfloat16, "cuda")
        ref = lora_linear(**p, impl="torch")
        fl = 2 * T * H * N + 2 * T * R * (len(widths) * H + N)
        fb = (N * H + L * (len(widths) * R * H + N * R) + T * H + T * N) * 2
        for impl, fn in dense_impls(p).items():
            log(f"check lora_linear {name} T={T} L={L} {impl}: rel err {rel_err(fn(), ref):.2e}")
            record("lora_linear", lab, T, L, impl, bench(fn), fl, fb)
        if L == 1:  # the bases alone: what the LoRA passes add to, and the old runtime's base without LoRA
            base = dict(p, lora_a=None, lora_b=None, scaling=None, token_adapter=None)
            fl0, fb0 = 2 * T * H * N, (N * H + T * H + T * N) * 2
            record("lora_linear", lab, T, 0, "cublas_base", bench(lambda p=p: base_linear(p["x"], p["w"])), fl0, fb0)
            record(
                "lora_linear",
                lab,
                T,
                0,
                "triton_fused_no_lora",
                bench(lambda base=base: lora_linear(**base, impl="triton", fused=True)),
                fl0,
                fb0,
            )
        del p, ref
        torch.cuda.empty_cache()

    csvf.close()
    log(f"wrote {len(rows)} rows to {path}")


def check_baselines():
    """CPU sanity of the benchmark's own baselines (torch grouped_mm path, HF module wiring) at small shapes."""
    torch.manual_seed(0)
    for s in (
        MoeShape("qwen3-tiny", 8, 64, 32, 2, "silu", False),
        MoeShape("gpt-oss-tiny", 4, 64, 48, 2, "swiglu_oai", True),
    ):
        for L in (0, 1, 3):
            p = make_inputs(s, 37, L, 16, torch.float32, "cpu")
            ref = moe_forward(p, impl="torch")
            err = ((torch_grouped_lora(p) - ref).norm() / ref.norm()).item()
            print(f"{s.name} L={L}: torch grouped_mm + unfused LoRA rel err {err:.2e}")
            assert err < 1e-5
            for mode in ("once", "fused"):  # the staged launches the GPU run times, interpreted
                err = rel_err(stage_breakdown(p, mode, timer=untimed)[1], ref)
                print(f"{s.name} L={L}: triton stages, lora_shrink={mode}, rel err {err:.2e}")
                assert err < 1e-5, mode
            # the grouped_mm backend: torch's CPU grouped_mm + the Triton passes interpreted
            err = rel_err(moe_forward(p, impl="triton", backend="grouped_mm"), ref)
            print(f"{s.name} L={L}: grouped_mm backend rel err {err:.2e}")
            assert err < 1e-5
            if L == 0:
                with torch.no_grad():
                    err = ((hf_experts(s, p)() - ref).norm() / ref.norm()).item()
                print(f"{s.name}: HF experts rel err {err:.2e}")
                assert err < 1e-5
    for name, H, widths in (("qkv-tiny", 40, (24, 8, 12)), ("o-tiny", 48, (36,))):
        for L in (1, 3):  # 37 rows over 3 adapters: runs that do not split evenly
            p = dense_inputs(37, L, H, widths, 16, torch.float32, "cpu")
            ref = lora_linear(**p, impl="torch")
            for impl, fn in dense_impls(p).items():  # the Triton paths through the interpreter
                err = rel_err(fn(), ref)
                print(f"lora_linear {name} L={L} {impl}: rel err {err:.2e}")
                assert err < 1e-5, impl
    print("baselines ok")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"bench_kernels done in {time.time() - t0:.0f} s")
