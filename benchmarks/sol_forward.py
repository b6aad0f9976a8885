"""Speed of light of one prompt-logprob call at a model's shapes on this GPU: what any implementation of the
forward could reach if every matrix product ran as a single cuBLAS GEMM and the rest moved its bytes at copy speed.

Each layer is timed as its GEMMs and attention only, on random buffers (nothing here computes the model):
  q|k|v, o, the router    one cuBLAS GEMM each ((T, H) rows, T = batch x seq)
  attention               one SDPA call, causal, on (batch, heads, seq, head_dim) buffers, k and v at every query
                          head (GQA's FLOPs; sliding windows and sinks ignored: full causal is the larger cost, and
                          attention is a few % of the call)
  experts                 gate_up and down as batched GEMMs over E experts of exactly T*K/E pre-gathered rows:
                          perfectly balanced routing, no gather, no padding rows, activation and top-k weights
                          folded away (--dense-experts: one dense GEMM each over one expert's weight, the
                          same FLOPs without the weight streaming: the bound at the dense GEMMs' rate;
                          --expert-rows padded: each expert the rows the runtime's routing blocks run at evenly
                          spread routing, 64-row steps with padding, ~32 rows an expert: the bound at that padding)
  lm_head                 one (T, H) x (H, V) GEMM
and, with a LoRA (rank R, one adapter on q/k/v/o and every expert), each shrink as its own GEMM and each expand as
extra K of the base GEMM (q|k|v, gate_up, down) or an addmm (o, whose shrink is extra output rows of its GEMM):
the runtime's own folding (kernels/lora_linear.py, kernels/fused_moe_lora.py), at cuBLAS speed.
The whole call (every layer, then the lm_head) is captured in one CUDA graph and replayed the way
benchmarks/bench_e2e.py times the runtime (median of --reps calls after warm-up), so the sustained clock under
the GPU's power cap is in the number, as it is in the runtime's.
The memory-bound passes the runtime also runs are added as a floor, their bytes at the device-to-device copy
bandwidth measured in the same run (read + write): per layer two residual adds + RMSNorms (read x and residual,
write both), the top-k sum (K rows read per token), q/k norm + rope (q and k read and written); the x gather,
the activation pass, routing and the log-softmax pass are taken as free.

The hybrid families (Qwen3.5-MoE, Nemotron-H: Gated DeltaNet, Mamba-2, shared and latent experts) are counted by
benchmarks/sol_hybrid.py in the same way; its docstring defines their linear-attention / SSD bounds.

Printed per model: the graph's ms per call (base / LoRA), the floor's ms, the total, tokens/s, and each GEMM alone
by do_bench (one launch at a time: boost clocks, not the power-capped sustained rate) with how many times a call
runs it. By default all four families, each at full depth except Nemotron-3-Super, which runs at the depth whose
weights + LoRA fit one H200 (sol_hybrid.FIT_GB: 43 of its 88 layers) unless --layers is given.

    python -m benchmarks.sol_forward [--models qwen3-30b-a3b gpt-oss-20b qwen3.5-35b-a3b nemotron-3-nano-30b-a3b
        nemotron-3-super-120b-a12b] [--batch 8 --seq 512 --rank 32] [--reps 10] [--layers N] [--dense-experts]
        [--expert-rows balanced|padded] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

# the four families (benchmarks/sol_hybrid.py for Qwen3.5 and Nemotron-H); FIT_MODELS run at the depth that fits one
# GPU unless --layers says otherwise
MODELS = ("qwen3-30b-a3b", "gpt-oss-20b", "qwen3.5-35b-a3b", "nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b")
FIT_MODELS = ("nemotron-3-super-120b-a12b",)


@dataclass(slots=True)
class Shapes:
    """One model's forward at one batch: T tokens in B prompts of S, hidden H, experts E of width I, top-k K,
    attention q (query heads x head_dim), kv, vocab V, LoRA rank R (0: none)."""

    T: int
    B: int
    S: int
    H: int
    L: int
    E: int
    I: int
    K: int
    heads: int
    kv_heads: int
    d: int
    V: int
    padded_m: int = 0  # rows per expert when the bound counts the routing's padding (--expert-rows padded)

    def __post_init__(self):
        assert self.T == self.B * self.S and (self.T * self.K) % self.E == 0, (
            "balanced routing needs T * K to be a multiple of E"
        )

    @property
    def m(self) -> int:  # rows per expert at perfectly balanced routing (or padded_m)
        return self.padded_m or self.T * self.K // self.E


def expert_rows(counts, block_m: int, half: bool) -> int:
    """Rows the expert GEMMs run for these per-group pair counts: each non-empty group padded to block_m, its last
    block run as block_m / 2 rows when at most half of it is used and ``half`` (GemmConfig.padding "half", which
    the kernel takes from block_m HALF_TAIL_MIN_M on: gemm_config.half_tail)."""
    from lpdiff.kernels.gemm_config import HALF_TAIL_MIN_M

    halve = half and block_m >= HALF_TAIL_MIN_M
    full, rem = np.divmod(np.asarray(counts, dtype=np.int64), block_m)
    last = np.where(rem == 0, 0, np.where(halve & (rem <= block_m // 2), block_m // 2, block_m))
    return int((full * block_m + last).sum())


def padded_rows(T: int, E: int, K: int, seed: int = 0) -> int:
    """Rows per expert, rounded up, that the runtime's expert GEMMs run at evenly spread routing (top-k of Gaussian
    logits, the routing bench_kernels times): each expert's pairs in routing blocks with half-height last blocks
    (expert_rows), the block the runtime picks for these shapes (gemm_config.routing_block_m). Same
    FLOPs as that padded routing, spread evenly so that the batched GEMMs can run it."""
    from lpdiff.kernels.gemm_config import routing_block_m

    logits = np.random.default_rng(seed).standard_normal((T, E), dtype=np.float32)
    counts = np.bincount(np.argpartition(-logits, K - 1, axis=1)[:, :K].ravel(), minlength=E)
    bm = routing_block_m(T * K, E)
    return -(-expert_rows(counts, bm, True) // E)


def shapes_of(model: str, batch: int, seq: int, layers: int | None) -> Shapes:
    from lpdiff.engines.triton.archs import model_config
    from lpdiff.harness.spec.catalog import get_model, hf_config

    cfg = model_config(hf_config(get_model(model, num_layers=layers)))
    return Shapes(
        T=batch * seq,
        B=batch,
        S=seq,
        H=cfg.hidden_size,
        L=cfg.num_layers,
        E=cfg.num_experts,
        I=cfg.expert_width,
        K=cfg.top_k,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        d=cfg.head_dim,
        V=cfg.vocab_size,
    )


class SolForward:
    """Buffers for one call, base and LoRA variants apart so that each GEMM reads contiguous operands (one layer's
    weights serve every layer: each layer's expert weights are far larger than L2, so nothing of them survives to
    the next layer anyway), and the call itself."""

    def __init__(self, s: Shapes, rank: int, device: str, dtype: torch.dtype, dense_experts: bool = False):
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape):  # random, not zeros: zeros cost the tensor cores less energy under the power cap
            return torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02

        self.s, self.R, self.dense_experts = s, rank, dense_experts
        q, R = s.heads * s.d, rank
        self.n_qkv = q + 2 * s.kv_heads * s.d
        self.x = rnd(s.T, s.H)
        # k and v at every query head: the FLOPs are the same as GQA's, and SDPA's fastest kernels take it
        self.q, self.k, self.v = (rnd(s.B, s.heads, s.S, s.d) for _ in range(3))
        self.attn = rnd(s.T, q)
        self.router_w = rnd(s.E, s.H)
        self.lm_head = rnd(s.V, s.H)
        # per variant r (0 and R): extra K of q|k|v, gate_up, down; extra output rows of o
        self.w = {
            r: dict(
                xa=rnd(s.T, s.H + 3 * r),
                qkv=rnd(self.n_qkv, s.H + 3 * r),
                o=rnd(s.H + r, q),
                xe=rnd(s.E, s.m, s.H + r),
                gu=rnd(s.E, 2 * s.I, s.H + r),
                he=rnd(s.E, s.m, s.I + r),
                dn=rnd(s.E, s.H, s.I + r),
            )
            for r in sorted({0, R})
        }
        if R:
            self.a_qkv, self.b_o, self.s_o = rnd(3 * R, s.H), rnd(s.H, R), rnd(s.T, R)
            self.a_gu, self.a_dn = rnd(s.E, R, s.H), rnd(s.E, R, s.I)
            self.x_e, self.h_e = rnd(s.E, s.m, s.H), rnd(s.E, s.m, s.I)
            self.out = rnd(s.T, s.H)

    def gemms(self, lora: bool) -> dict:
        """name -> (fn, flops) of every product of one layer, as the call runs them."""
        s, R = self.s, self.R if lora else 0
        w, H, I, q = self.w[R], s.H, s.I, s.heads * s.d
        ops = {
            "qkv": (lambda: F.linear(w["xa"], w["qkv"]), 2 * s.T * self.n_qkv * (H + 3 * R)),
            "attention": (
                lambda: F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True),
                2 * 2 * s.B * s.heads * s.S * s.S * s.d // 2,
            ),
            "o": (lambda: F.linear(self.attn, w["o"]), 2 * s.T * (H + R) * q),
            "router": (lambda: F.linear(self.x, self.router_w), 2 * s.T * s.E * H),
            "gate_up": (lambda: torch.bmm(w["xe"], w["gu"].transpose(1, 2)), 2 * s.E * s.m * 2 * I * (H + R)),
            "down": (lambda: torch.bmm(w["he"], w["dn"].transpose(1, 2)), 2 * s.E * s.m * H * (I + R)),
        }
        if self.dense_experts:  # one (T*K, K_in) x (K_in, N) GEMM each, over the first expert's weight
            ops |= {
                "gate_up": (lambda: F.linear(w["xe"].view(-1, H + R), w["gu"][0]), ops["gate_up"][1]),
                "down": (lambda: F.linear(w["he"].view(-1, I + R), w["dn"][0]), ops["down"][1]),
            }
        if R:
            ops |= {
                "qkv shrink": (lambda: F.linear(self.x, self.a_qkv), 2 * s.T * 3 * R * H),
                "o expand": (lambda: self.out.addmm_(self.s_o, self.b_o.T), 2 * s.T * H * R),
                "gate_up shrink": (lambda: torch.bmm(self.x_e, self.a_gu.transpose(1, 2)), 2 * s.E * s.m * R * H),
                "down shrink": (lambda: torch.bmm(self.h_e, self.a_dn.transpose(1, 2)), 2 * s.E * s.m * R * I),
            }
        return ops

    def lm_head_op(self):
        return (lambda: F.linear(self.x, self.lm_head)), 2 * self.s.T * self.s.V * self.s.H

    def count(self, name: str) -> int:
        """How many times the call runs product ``name``: once per layer, the lm_head once."""
        return 1 if name == "lm_head" else self.s.L

    def call(self, lora: bool) -> None:
        ops = [fn for fn, _ in self.gemms(lora).values()]
        for _ in range(self.s.L):
            for fn in ops:
                fn()
        self.lm_head_op()[0]()

    def floor_bytes(self) -> int:
        """Bytes of the memory-bound passes of one call (see the module docstring)."""
        s = self.s
        el = self.x.element_size()
        row = s.H * el
        norms = 2 * 4 * s.T * row  # two residual adds + RMSNorms per layer: read x, residual; write both
        topk_sum = s.K * s.T * row  # the next norm reads the K weighted expert rows of each token
        rope = 2 * s.T * (s.heads + s.kv_heads) * s.d * el  # q and k read and written once
        return s.L * (norms + topk_sum + rope) + 2 * s.T * row  # + the final norm


def copy_bandwidth(device: str, nbytes: int | None = None) -> float:
    """Device-to-device copy, bytes moved (read + write) per second, median of a few. 1 GiB on a GPU (past any
    cache); 16 MiB on a CPU, where the number only has to exist (tests)."""
    nbytes = nbytes or (1 << 30 if device == "cuda" else 1 << 24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[2:])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fwd: SolForward, lora: bool, warmup: int, reps: int, graphs: bool) -> float:
    """Median seconds per call: the call replayed from a CUDA graph (graphs) or run eagerly."""
    run = lambda: fwd.call(lora)  # noqa: E731
    if graphs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm cuBLAS's handles and workspaces outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    for _ in range(warmup):
        run()
    walls = []
    for _ in range(reps):
        sync(fwd.x.device.type)
        t0 = time.perf_counter()
        run()
        sync(fwd.x.device.type)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def bench_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def depth_of(model: str, args) -> int | None:
    """--layers, or for a model whose full depth does not fit one GPU the depth that does (sol_hybrid.FIT_GB)."""
    if args.layers is not None or model not in FIT_MODELS:
        return args.layers
    from benchmarks.sol_hybrid import FIT_GB, fit_depth

    return fit_depth(model, args.batch, args.seq, args.rank, FIT_GB * 1e9)


def sol(model: str, args) -> dict:
    from benchmarks.sol_hybrid import HybridForward, hybrid_shapes, is_hybrid, weight_bytes

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    layers = depth_of(model, args)
    hybrid = is_hybrid(model)
    s = hybrid_shapes(model, args.batch, args.seq, layers) if hybrid else shapes_of(model, args.batch, args.seq, layers)
    what = ""
    if args.expert_rows == "padded":  # the same GEMMs at the rows the runtime's routing blocks make them run
        balanced = s.m
        s = replace(s, padded_m=padded_rows(s.T, s.E, s.K))
        what = f" (padded as the runtime's blocks pad evenly spread routing: {s.m / balanced - 1:+.1%} rows)"
    if hybrid:
        fwd = HybridForward(s, args.rank, args.device, dtype)
        w, lo = weight_bytes(s, args.rank)
        what += (
            f"; layers {', '.join(f'{n} {k}' for k, n in count_kinds(s.kinds).items())}; weights {w / 1e9:.1f} "
            f"GB + LoRA {lo / 1e9:.2f} GB in bf16"
        )
    else:
        fwd = SolForward(s, args.rank, args.device, dtype, args.dense_experts)
        what += " as one dense GEMM" if args.dense_experts else ""
    graphs = args.device == "cuda"
    bw = copy_bandwidth(args.device)
    floor_s = fwd.floor_bytes() / bw
    out = dict(model=model, layers=s.L, tokens=s.T, copy_tb_s=bw / 1e12, floor_ms=floor_s * 1e3)
    print(
        f"{model}: {s.L} layers{f' (--layers {layers})' if layers else ''}, T {s.T} ({s.B} x {s.S}), experts {s.E} "
        f"x {s.m} rows{what}, LoRA rank {args.rank}; copy bandwidth {bw / 1e12:.2f} TB/s -> memory-bound passes "
        f"{floor_s * 1e3:.2f} ms per call",
        flush=True,
    )
    for lora in (False, True):
        tag = "lora" if lora else "base"
        call_s = time_call(fwd, lora, args.warmup, args.reps, graphs)
        total = call_s + floor_s
        out |= {f"{tag}_gemm_ms": call_s * 1e3, f"{tag}_ms": total * 1e3, f"{tag}_tokens_per_s": s.T / total}
        # the clock the replays ended at, beside the runtime's profile's (bench_e2e --profile): under the 700 W cap
        # gpt-oss's runtime ran at 1530 MHz, Qwen3's at 1680, Nano's at 1800
        clock = f"; SM clock {sm_clock()} MHz after the replays" if graphs else ""
        print(
            f"  {tag}: GEMMs + attention {call_s * 1e3:.2f} ms + floor {floor_s * 1e3:.2f} = {total * 1e3:.2f} ms "
            f"per call -> {s.T / total:,.0f} tokens/s{clock}",
            flush=True,
        )
    ops = fwd.gemms(lora=True) | {"lm_head": fwd.lm_head_op()}
    base_ops = fwd.gemms(lora=False)
    for name, (fn, flops) in ops.items():
        ms = bench_ms(fn, args.device)
        n = fwd.count(name)
        per_call = ms * n
        line = f"    {name:15s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s  x{n}"
        if args.rank and name in base_ops:
            bms = bench_ms(base_ops[name][0], args.device)
            line += f"  (without LoRA {bms * 1e3:.1f} us)"
        print(line + f"  = {per_call:.2f} ms per call", flush=True)
        out[f"op_{name}_us"] = ms * 1e3
    return out


def sm_clock() -> str:
    """The SM clock now in MHz (nvml), or why it is not known."""
    try:
        return str(torch.cuda.clock_rate())
    except Exception as e:  # noqa: BLE001 - nvml may be missing; the timings stand without it
        return f"n/a ({type(e).__name__})"


def count_kinds(kinds) -> dict:
    out: dict = {}
    for ks in kinds:
        key = "+".join(ks)
        out[key] = out.get(key, 0) + 1
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--layers", type=int, default=None, help="reduced depth (default: full depth)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--dense-experts",
        action="store_true",
        help="the expert GEMMs as one dense GEMM each over the first expert's weight (same FLOPs, no "
        "weight streaming): the bound if they ran at the dense GEMMs' rate (Qwen3-MoE and gpt-oss; "
        "the hybrids' experts stay batched)",
    )
    p.add_argument(
        "--expert-rows",
        choices=("balanced", "padded"),
        default="balanced",
        help="balanced: every expert T*K/E rows, no padding (the bound); padded: the rows the runtime's routing "
        "blocks run at evenly spread routing (half-height last blocks; padded_rows), spread evenly",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.device == "cuda":
        print(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    results = []
    for model in args.models:
        results.append(sol(model, args))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
