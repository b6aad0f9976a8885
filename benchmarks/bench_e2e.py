"""End-to-end prompt-logprob throughput: the triton runtime (base and with a rank-32 LoRA on q/k/v/o and every
expert's gate_up/down) against HF+PEFT (engines.hf, grouped_mm experts), measured in the same run on the same GPU,
with peak GPU memory against the runtime's weights + LoRA bytes.

    python -m benchmarks.bench_e2e --models qwen3-30b-a3b gpt-oss-20b --out DIR [--commit SHA] [--layers N]
        [--moe-backend triton [grouped_mm]]   # the triton engine's moe_backend option(s), each timed in the same
                                              # run (impl column triton / triton+BACKEND)

Models are the catalog's full-size configs built on the GPU with the seeded recipe (no downloads); both engines
see the same weights. Rows are appended to DIR/e2e.csv as they are measured (columns of
benchmarks/results/e2e.csv), so a run cut short still leaves what it finished.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import gzip
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.triton.options import ATTENTION, DEFAULTS as OPTIONS
from lpdiff.kernels import fused_moe_lora as fm
from lpdiff.kernels.fused_moe_lora import MOE_EXPAND
from lpdiff.kernels.gemm_config import EXPAND
from lpdiff.kernels.moe_grouped import BACKENDS
from lpdiff.harness.types import AdapterSpec

COLUMNS = ["date", "commit", "gpu", "model", "tokens", "tp", "dtype", "adapter", "impl", "tokens_per_s",
           "peak_mem_gb"]


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def timed(eng, prompts, adapter, warmup: int, reps: int) -> tuple[float, float]:
    """-> (median seconds per call, peak GB allocated during the timed calls)."""
    for _ in range(warmup):
        eng.prompt_logprobs(prompts, adapter)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.prompt_logprobs(prompts, adapter)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), torch.cuda.max_memory_allocated() / 1e9


def make_adapter(spec, out_dir: Path, rank: int) -> AdapterSpec:
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import load_hf_model

    model = load_hf_model(spec, torch.bfloat16, "cuda")
    t0 = time.perf_counter()
    ad = generate_adapter(model, out_dir, groups=("attention", "experts"), rank=rank, alpha=2 * rank, seed=1,
                          dtype=torch.bfloat16)
    log(f"adapter rank {rank} generated in {time.perf_counter() - t0:.1f} s")
    del model
    free_gpu()
    return AdapterSpec("r%d" % rank, ad.path)


def impl_name(backend: str, graphs: bool, shrink: str = OPTIONS["moe_lora_shrink"],
              padding: str = OPTIONS["moe_padding"], expand: str = MOE_EXPAND,
              attention: str = OPTIONS["attention"]) -> str:
    return (("triton" if backend == "triton" else f"triton+{backend}") + ("" if graphs else "-eager")
            + ("" if shrink == OPTIONS["moe_lora_shrink"] else f"@{shrink}")
            + ("" if padding == OPTIONS["moe_padding"] else f"@pad:{padding}")
            + ("" if expand == MOE_EXPAND else f"@expand:{expand}")
            + ("" if attention == OPTIONS["attention"] else f"@attn:{attention}"))


def bench_model(name: str, args, writer) -> None:
    from lpdiff.engines.hf import HFEngine
    from lpdiff.engines.triton import TritonEngine
    from lpdiff.harness.spec.catalog import get_model

    spec = get_model(name, num_layers=args.layers)
    tokens = args.batch * args.seq
    g = torch.Generator().manual_seed(0)
    gpu = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(spec, Path(tmp) / "r32", args.rank)
        adapters = {adapter.name: adapter}
        from lpdiff.harness.spec.catalog import hf_config

        vocab = hf_config(spec).vocab_size
        prompts = [torch.randint(0, vocab, (args.seq,), generator=g).tolist() for _ in range(args.batch)]

        def row(adapter_name, impl, secs, peak):
            r = dict(date=datetime.date.today().isoformat(), commit=args.commit, gpu=gpu, model=spec.name +
                     (f"-{args.layers}L" if args.layers else ""), tokens=tokens, tp=1, dtype="bfloat16",
                     adapter=adapter_name, impl=impl, tokens_per_s=round(tokens / secs), peak_mem_gb=round(peak, 2))
            writer(r)
            log(r)
            return r

        results, outs = {}, {}
        if not args.skip_hf:
            t0 = time.perf_counter()
            with HFEngine(EngineConfig(model=spec, adapters=adapters, dtype="bfloat16", device="cuda",
                                       options={"router_margins": False})) as hf:
                log(f"hf loaded in {time.perf_counter() - t0:.1f} s")
                for a in (None, adapter.name):
                    secs, peak = timed(hf, prompts, a, 1, args.hf_reps)
                    results[("hf", a)] = row(f"r{args.rank}" if a else "none", "hf+peft" if a else "hf", secs, peak)
                    outs[("hf", a)] = hf.prompt_logprobs(prompts, a)
            free_gpu()
        # CUDA graphs on (the engine's default) and, with --graphs both, off: impl "...-eager"
        # and each --moe-shrink value (the engine's moe_lora_shrink option; impl "...@<value>" unless the default)
        # and each --moe-padding value (moe_padding; impl "...@pad:<value>" unless the default)
        # and each --moe-expand value (fused_moe_lora.MOE_EXPAND while that engine runs; impl "...@expand:<value>"
        # unless the default)
        # and each --attention value (the engine's attention option; impl "...@attn:<value>" unless the default)
        variants = [(b, g, sh, pad, ex, at) for b in args.moe_backend for sh in args.moe_shrink
                    for pad in args.moe_padding for ex in args.moe_expand for at in args.attention
                    for g in {"on": (True,), "off": (False,), "both": (True, False)}[args.graphs]]
        for backend, graphs, shrink, padding, expand, attn in variants:
            opts = {"moe_backend": backend, "cuda_graphs": OPTIONS["cuda_graphs"] if graphs else 0,
                    "moe_lora_shrink": shrink, "moe_padding": padding, "attention": attn}
            impl = impl_name(backend, graphs, shrink, padding, expand, attn)
            fm.MOE_EXPAND = expand
            t0 = time.perf_counter()
            with TritonEngine(EngineConfig(model=spec, adapters=adapters, dtype="bfloat16", device="cuda",
                                           options=opts)) as tr:
                wbytes = tr.runtime.weights.nbytes()
                lbytes = tr.runtime.lora.nbytes()
                log(f"{impl} loaded in {time.perf_counter() - t0:.1f} s: weights {wbytes / 1e9:.2f} GB, "
                    f"LoRA {lbytes / 1e9:.2f} GB, allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB")
                for a in (None, adapter.name):
                    # 3 warm-up calls: the 2nd captures the layout's CUDA graph, the 3rd is its first replay
                    secs, peak = timed(tr, prompts, a, 3, args.reps)
                    results[(impl, a)] = row(f"r{args.rank}" if a else "none", impl, secs, peak)
                    outs[(impl, a)] = tr.prompt_logprobs(prompts, a)
                log(f"{impl}: reserved {torch.cuda.max_memory_reserved() / 1e9:.2f} GB at most (allocator pools and "
                    f"graph pools), graphs {tr.runtime.graphs and (tr.runtime.graphs.captures, tr.runtime.graphs.hits)}"
                    " (captures, replays)")
                if args.split and graphs:
                    for a in (None, adapter.name):
                        host_split(tr, prompts, a, args.reps)
                first_variant = (shrink, padding, expand, attn) == (args.moe_shrink[0], args.moe_padding[0],
                                                                    args.moe_expand[0], args.attention[0])
                if args.profile and graphs == (args.graphs != "off") and (first_variant or args.profile_all):
                    stem = f"profile_{name}_{impl}".replace("@", "_").replace(":", "-")  # file names the device returns
                    profile(tr, prompts, adapter.name, Path(args.out) / f"{stem}.txt")
                    profile(tr, prompts, None, Path(args.out) / f"{stem}_base.txt")
                    if first_variant:
                        breakdown(tr, prompts, adapter.name)
            free_gpu()
        fm.MOE_EXPAND = MOE_EXPAND
        first = impl_name(*variants[0])
    # the other runs are compared with the first backend named
    for a in (None, adapter.name):  # bf16 agreement: noisy on random full-size models, but catches gross errors
        for other in dict.fromkeys(["hf"] + [k for k, _ in outs if k.startswith("triton") and k != first]):
            if (other, a) in outs:
                d = torch.cat([torch.from_numpy(x.logprobs - y.logprobs)
                               for x, y in zip(outs[(first, a)], outs[(other, a)])])
                log(f"bf16 {first} vs {other} adapter={a}: k2 {0.5 * d.pow(2).mean():.3g}, max |d| "
                    f"{d.abs().max():.3g}, mean |d| {d.abs().mean():.3g}")
    for impl in (k for k, a in results if k.startswith("triton") and a is None):
        base, lora = results[(impl, None)], results[(impl, adapter.name)]
        summary = {"model": spec.name, "impl": impl, "lora_tok_s": lora["tokens_per_s"],
                   "base_tok_s": base["tokens_per_s"],
                   "lora_overhead_pct": round(100 * (base["tokens_per_s"] / lora["tokens_per_s"] - 1), 1),
                   "peak_over_weights_lora_pct": round(100 * (lora["peak_mem_gb"] * 1e9 / (wbytes + lbytes) - 1), 1)}
        if ("hf", adapter.name) in results:
            summary["speedup_vs_hf_peft"] = round(lora["tokens_per_s"] / results[("hf", adapter.name)]["tokens_per_s"],
                                                  2)
        log("SUMMARY", summary)


def host_split(eng, prompts, adapter, reps: int) -> dict:
    """Where a replayed call's wall time goes: the whole call (prompt_logprobs), the graph replay alone (replay +
    sync, no host work around it), the replay's GPU time between CUDA events, and the SM clock after the loop (a
    throttled clock under sustained load would show as replay time above the profiled GPU time). Logged; -> dict
    of medians in ms."""
    import cProfile
    import io
    import pstats

    rt = eng.runtime
    key = rt.layout(prompts, [rt.slot(adapter)] * len(prompts), 0)
    entry = rt.graphs.graphs.get(key) if rt.graphs is not None else None
    if entry is None:
        log(f"split adapter={adapter}: no graph for this layout, skipped")
        return {}
    call = timed(eng, prompts, adapter, 0, reps)[0]
    replays, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        entry.graph.replay()
        torch.cuda.synchronize()
        replays.append(time.perf_counter() - t0)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        entry.graph.replay()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / 1e3)
    med = {"call": 1e3 * call, "replay": 1e3 * statistics.median(replays), "replay_gpu": 1e3 * statistics.median(gpu)}
    try:
        clock = torch.cuda.clock_rate()
    except Exception as e:  # noqa: BLE001 - nvml may be missing; the split stands without it
        clock = f"n/a ({type(e).__name__})"
    log(f"split adapter={adapter}: call {med['call']:.2f} ms, replay+sync {med['replay']:.2f} ms, replay GPU (events) "
        f"{med['replay_gpu']:.2f} ms -> host around the replay {med['call'] - med['replay']:.2f} ms; "
        f"SM clock {clock} MHz")
    prof = cProfile.Profile()
    prof.enable()
    eng.prompt_logprobs(prompts, adapter)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print(buf.getvalue()[:4000], flush=True)
    return med


def profile(eng, prompts, adapter, path: Path) -> None:
    """Top CUDA kernels of one call (where the time goes), with ``adapter`` (None: the base call)."""
    from torch.profiler import ProfilerActivity, profile as tprof

    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.prompt_logprobs(prompts, adapter)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    # where the GPU waits on the host (benchmarks/trace_gaps.py): the gzipped chrome trace comes back for a closer look
    from benchmarks.trace_gaps import analyse, load_events, report

    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    gaps = report(analyse(load_events(trace), min_gap_us=20), top=20)
    with open(trace, "rb") as src, gzip.open(path.with_suffix(".trace.json.gz"), "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    path.write_text(table + "\n\nGPU idle gaps (>= 20 us):\n" + gaps + "\n")
    print(table[:6000], "\n" + gaps, flush=True)


def breakdown(eng, prompts, adapter: str, do_bench=None) -> dict:
    """Median time of each piece of one layer at the benchmark's shapes (triton.testing.do_bench), x num_layers,
    next to one whole forward: where the time goes, base and LoRA. -> {(piece, "base"|"lora"): ms}.
    ``do_bench``: the timer (tests pass one that runs each piece once on CPU)."""
    if do_bench is None:
        from triton.testing import do_bench

    from lpdiff.engines.triton.attention import attention
    from lpdiff.engines.triton.batch import Batch
    from lpdiff.engines.triton.moe import experts, route
    from lpdiff.engines.triton.rope import norm_rope_qk
    from lpdiff.engines.logprobs import chunked_logprobs

    rt = eng.runtime
    m, cfg = rt.model, rt.cfg
    lw, ll = m.w.layers[0], m.lora.layers[0]
    d, nl, H = cfg.head_dim, cfg.num_layers, cfg.hidden_size
    rows = {}
    for slot in (-1, rt.slot(adapter)):
        b = Batch.build(prompts, [slot] * len(prompts), cfg, rt.dtype, rt.device)
        T, ta = b.num_tokens, b.token_adapter
        x = torch.randn(T, H, dtype=rt.dtype, device=rt.device)
        # what the q|k|v projection reads: x, or the augmented buffer the input norm writes x into (LoRA batches)
        xa = m.qkv_input(b, x)
        h = x if xa is None else xa
        if xa is not None:
            xa[:, :H] = x
        qkv = m.qkv(h, lw, ll, b)
        q = qkv[:, : m.heads * d].view(T, m.heads, d)
        k = qkv[:, m.heads * d: (m.heads + m.kv_heads) * d].view(T, m.kv_heads, d)
        v = qkv[:, (m.heads + m.kv_heads) * d:].view(T, m.kv_heads, d)
        o = torch.randn(T, m.heads * d, dtype=rt.dtype, device=rt.device)
        ids, wts, _ = route(x, lw, cfg, m.impl)
        moe_out = experts(x, ids, wts, lw, cfg, ll.moe, ta, m.impl, m.moe_backend, sum_topk=not m.fuse_topk_sum,
                          shrink=m.moe_shrink, padding=m.moe_padding)
        tag = "lora" if slot >= 0 else "base"
        pieces = {
            "add_rms_norm (before attention)": lambda: m._norm(x, x, lw.input_norm,
                                                               None if xa is None else xa[:, :H]),
            "add_rms_norm (after o)": lambda: m._norm(x, x, lw.post_norm),
            # at TP 1 the MoE's top-k sum is fused into this norm (moe_out is (T, K, H) there)
            "add_rms_norm (moe top-k)": lambda: m._norm(x, moe_out, lw.input_norm),
            "qkv lora_linear": lambda: m.qkv(h, lw, ll, b),
            "norm_rope q+k": lambda: norm_rope_qk(q, k, lw.q_norm, lw.k_norm, cfg.rms_norm_eps, b.cos, b.sin),
            "attention": lambda: attention(q, k, v, b, d ** -0.5, cfg.sliding_windows[0], lw.sinks, m.attention_impl),
            "o lora_linear": lambda: m.o_proj(o, lw, ll, b),
            "router+route": lambda: route(x, lw, cfg, m.impl),
            "moe_forward": lambda: experts(x, ids, wts, lw, cfg, ll.moe, ta, m.impl, m.moe_backend,
                                           sum_topk=not m.fuse_topk_sum, shrink=m.moe_shrink, padding=m.moe_padding),
        }
        for piece, fn in pieces.items():
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            rows[(piece, tag)] = ms * nl
        sel = torch.arange(T - 1, device=rt.device)
        for fused in (False, True):  # torch fp32 softmax vs the one-pass kernel (kernels/logprob.py)
            rows[(f"logprobs (once{', fused' if fused else ''})", tag)] = do_bench(lambda: chunked_logprobs(
                x[sel], rt.weights.lm_head, b.input_ids[sel + 1], 0, rt.logit_chunk, fused=fused), warmup=5,
                rep=50, return_mode="median")
        rows[("whole forward", tag)] = do_bench(lambda: m.forward(b), warmup=3, rep=20, return_mode="median")
    print(f"{'piece (x layers)':28s} {'base ms':>9s} {'lora ms':>9s}", flush=True)
    for piece in dict.fromkeys(p for p, _ in rows):
        print(f"{piece:28s} {rows[(piece, 'base')]:9.2f} {rows[(piece, 'lora')]:9.2f}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--commit", default="unknown")
    p.add_argument("--layers", type=int, default=None, help="reduced depth (default: full depth)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hf-reps", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-all", action="store_true", help="with --profile: every shrink/padding variant, not "
                   "only the first")
    p.add_argument("--split", action="store_true",
                   help="graph variants: split a call's wall time into the replay and the host work around it")
    p.add_argument("--graphs", choices=("on", "off", "both"), default="both",
                   help="the triton engine's CUDA graphs: on (default option), off (impl '...-eager'), or both timed")
    p.add_argument("--moe-shrink", nargs="+", default=[OPTIONS["moe_lora_shrink"]],
                   help="the triton engine's moe_lora_shrink option(s), each timed in this run (e.g. auto once "
                        "fused:6,8)")
    p.add_argument("--moe-padding", nargs="+", default=[OPTIONS["moe_padding"]],
                   help="the triton engine's moe_padding option(s), each timed in this run (auto compute zero half)")
    p.add_argument("--moe-expand", nargs="+", default=[MOE_EXPAND], choices=EXPAND,
                   help="where the expert GEMMs' LoRA expand runs (GemmConfig.expand, kernels/fused_moe_lora.py "
                        "EXPAND): the K-loop's first step (loop, the default), before the K-loop (first) or in the "
                        "epilogue (last); each timed in this run")
    p.add_argument("--attention", nargs="+", default=[OPTIONS["attention"]], choices=ATTENTION,
                   help="the triton engine's attention option(s) (engines/triton/attention.py), each timed in this run")
    p.add_argument("--moe-backend", nargs="+", default=["triton"], choices=BACKENDS,
                   help="the triton engine's moe_backend option(s) (kernels/moe_grouped.py), each timed in this run")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out) / "e2e.csv"
    new = not out.exists()
    with open(out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()

        def writer(r):
            w.writerow(r)
            f.flush()

        for name in args.models:
            try:
                bench_model(name, args, writer)
            except Exception as e:  # one model failing must not lose the other's numbers
                import traceback

                traceback.print_exc()
                log(f"{name} FAILED: {e!r}")


if __name__ == "__main__":
    main()
