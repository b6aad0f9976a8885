"""benchmarks/bench_e2e.py's looks inside one engine: a call's graph replayed alone beside the whole calls, the
profiler's top kernels and GPU idle gaps of one call, the rows the batch's routing makes the expert GEMMs run, and
the per-piece breakdown of one layer at the benchmark's shapes."""

from __future__ import annotations

import gzip
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.sol_forward import expert_rows, sm_clock


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def bare_replays(eng, prompts, adapter, reps: int) -> dict:
    """The graph of a call replayed alone, back to back (replay + sync, no host work between), beside the whole
    calls (prompt_logprobs), the replay's GPU time between CUDA events, and the SM clock after the loop; then a
    cProfile of one whole call (its host functions). Under the H200's 700 W cap the bare replays ran 2.9-4.4 ms a
    call slower than whole calls at 1605-1665 MHz (benchmarks/results/e2e.md): a difference of the two is clock, not
    host time, which bench_e2e.host_split measures inside the timed calls. Logged; -> dict of medians in ms."""
    import cProfile
    import io
    import pstats

    rt = eng.runtime
    key = rt.layout(prompts, [rt.slot(adapter)] * len(prompts), 0)
    entry = rt.graphs.graphs.get(key) if rt.graphs is not None else None
    if entry is None:
        log(f"bare replays adapter={adapter}: no graph for this layout, skipped")
        return {}
    from benchmarks.bench_e2e import timed

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
    clock = sm_clock()
    log(
        f"bare replays adapter={adapter}: whole call {med['call']:.2f} ms, bare replay + sync {med['replay']:.2f} ms "
        f"(GPU {med['replay_gpu']:.2f} ms between events), {med['replay'] - med['call']:+.2f} ms against the whole "
        f"call; SM clock {clock} MHz after the loop"
    )
    prof = cProfile.Profile()
    prof.enable()
    eng.prompt_logprobs(prompts, adapter)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print(buf.getvalue()[:4000], flush=True)
    return med


# whole calls run back to back before the profiled ones: at 700 W the H200's SM clock drops within a few calls, so a
# single call profiled after a pause ran at boost clocks, 4-5 ms faster than the timed calls (gpt-oss: 55.3 ms busy
# against 60.3 ms a timed replay, e2e.md) and its kernels could not be set beside the bound's, timed sustained
PROFILE_WARM, PROFILE_CALLS = 8, 3


def profile(eng, prompts, adapter, path: Path, warm: int | None = None, calls: int | None = None):
    """Top CUDA kernels of a call (where the time goes), with ``adapter`` (None: the base call): ``calls`` whole
    calls profiled back to back after ``warm`` unprofiled ones, so the kernels run at the sustained clock the timed
    calls run at; the table's totals are over the ``calls`` calls, and a per-call table and the SM clock after them
    come first (PROFILE_WARM / PROFILE_CALLS unless given). On a CPU (the tiny zoo's dry runs) the top CPU ops of one
    call unless given, and no idle gaps: a trace without GPU kernels has none to find. -> its key_averages."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    cuda = eng.runtime.device.type == "cuda"
    warm = (PROFILE_WARM if cuda else 0) if warm is None else warm
    calls = (PROFILE_CALLS if cuda else 1) if calls is None else calls
    for _ in range(warm):
        eng.prompt_logprobs(prompts, adapter)
    # no schedule: torch's clears a cycle's events when the cycle ends, before key_averages could read them
    with tprof(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            eng.prompt_logprobs(prompts, adapter)
        if cuda:
            torch.cuda.synchronize()
    clock = sm_clock() if cuda else "n/a (CPU)"
    avgs = prof.key_averages()
    table = avgs.table(sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
    head = f"{calls} whole calls profiled after {warm} back to back; SM clock {clock} MHz after them\n"
    if cuda:
        head += per_call_kernels(avgs, calls) + "\n"
    # where the GPU waits on the host (benchmarks/trace_gaps.py): the gzipped chrome trace comes back for a closer look
    from benchmarks.trace_gaps import analyse, load_events, report

    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    gaps = report(analyse(load_events(trace), min_gap_us=20), top=20) if cuda else "none: no GPU in this run"
    with open(trace, "rb") as src, gzip.open(path.with_suffix(".trace.json.gz"), "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    path.write_text(head + "\n" + table + "\n\nGPU idle gaps (>= 20 us):\n" + gaps + "\n")
    print(head + "\n" + table[:6000], "\n" + gaps, flush=True)
    return avgs


def per_call_kernels(avgs, calls: int, top: int = 25) -> str:
    """The GPU kernels of a profile, per call: launches and ms a call, largest first, and their sum (device events
    only: a CPU op's self device time is its kernels' again)."""
    from torch.autograd import DeviceType

    rows = [
        (e.key, e.count / calls, e.self_device_time_total / 1e3 / calls)
        for e in avgs
        if e.device_type == DeviceType.CUDA
    ]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    out = [f"{'kernel (per call)':60s} {'launches':>8s} {'ms':>8s}"]
    out += [f"{k[:60]:60s} {n:8.1f} {ms:8.3f}" for k, n, ms in rows[:top]]
    out.append(f"{'all GPU time':60s} {'':8s} {total:8.3f}")
    return "\n".join(out)


def padding_stats(eng, prompts, adapter) -> dict:
    """What the routing of this batch costs the expert GEMMs before any kernel runs: per MoE layer the rows they
    execute (each expert's pairs padded to the routing block, half-height last blocks as the engine's default
    padding runs them, and with whole blocks) against the pairs themselves, and the busiest expert against the
    mean. The speed-of-light bound (sol_forward) times balanced routing, every expert P / E rows; its padding is in
    the log line too. One eager call with the routers recording (engines/triton/routing.py). -> dict, logged."""
    from lpdiff.engines.triton.routing import run_with_routing
    from lpdiff.kernels.gemm_config import routing_block_m

    rt = eng.runtime
    out = run_with_routing(rt, prompts, [rt.slot(adapter)] * len(prompts), 0)
    experts = np.concatenate([p.routed_experts for p in out])  # (T, MoE layers, K)
    T, layers, K = experts.shape
    E, P = rt.cfg.num_experts, T * K
    bm = routing_block_m(P, E * max(1, len(eng.config.adapters)))  # the block a GPU run picks
    half, whole, busiest = [], [], []
    for i in range(layers):
        counts = np.bincount(experts[:, i, :].ravel(), minlength=E)
        half.append(expert_rows(counts, bm, True) / P - 1)
        whole.append(expert_rows(counts, bm, False) / P - 1)
        busiest.append(counts.max() * E / P)
    balanced = np.full(E, P // E) + (np.arange(E) < P % E)
    stats = {
        "block_m": bm,
        "padding_half": float(np.mean(half)),
        "padding_whole": float(np.mean(whole)),
        "padding_balanced": expert_rows(balanced, bm, True) / P - 1,
        "busiest_over_mean": float(np.mean(busiest)),
    }
    log(
        f"routing adapter={adapter}: {P} pairs a layer ({T} tokens x top-{K}) into {E} experts, block_m {bm}: the "
        f"expert GEMMs run {100 * stats['padding_half']:+.1f} % rows over the pairs (mean of {layers} MoE layers, "
        f"{100 * min(half):+.1f} to {100 * max(half):+.1f} %; whole last blocks {100 * stats['padding_whole']:+.1f} "
        f"%), the busiest expert {stats['busiest_over_mean']:.2f}x the mean; balanced routing (the bound's) "
        f"{100 * stats['padding_balanced']:+.1f} %"
    )
    return stats


def cpu_bench(fn, warmup: int = 1, rep: int = 3, return_mode: str = "median") -> float:
    """triton.testing.do_bench's interface on a CPU (no CUDA events): the wall ms of one call after one warm-up (the
    CPU runs only check that the breakdown runs on the tiny zoo; their numbers rank nothing)."""
    for _ in range(min(warmup, 1)):
        fn()
    walls = []
    for _ in range(1):
        t0 = time.perf_counter()
        fn()
        walls.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(walls)


def breakdown(eng, prompts, adapter: str, do_bench=None) -> dict:
    """Median time of each piece of one layer of each kind at the benchmark's shapes, times the layers of that kind,
    next to one whole forward: where the time goes, base and LoRA. -> {(piece, "base"|"lora"): ms}. The full-attention
    families (MoeTransformer) here, Qwen3.5 and Nemotron-H in benchmarks/e2e_hybrid.py. ``do_bench``: the timer
    (triton.testing.do_bench on a GPU, cpu_bench on a CPU; tests pass one that runs each piece once)."""
    rt = eng.runtime
    if do_bench is None:
        if rt.device.type == "cuda":
            from triton.testing import do_bench
        else:
            do_bench = cpu_bench
    if hasattr(rt.model, "qkv_input"):
        rows, counts = transformer_breakdown(rt, prompts, adapter, do_bench)
    else:  # a hybrid arch's own model (engines/triton/archs.HYBRIDS)
        from benchmarks.e2e_hybrid import hybrid_breakdown

        rows, counts = hybrid_breakdown(rt, prompts, adapter, do_bench)
    print_breakdown(rows, counts)
    return rows


def print_breakdown(rows: dict, counts: dict) -> None:
    """One line per piece: how many times a forward runs it, its base and LoRA ms times that count, and that as a
    share of the whole LoRA forward."""
    whole = rows.get(("whole forward", "lora")) or float("nan")
    print(f"{'piece':44s} {'x':>4s} {'base ms':>9s} {'lora ms':>9s} {'of fwd':>7s}", flush=True)
    for piece in dict.fromkeys(p for p, _ in rows):
        b, lo = rows[(piece, "base")], rows[(piece, "lora")]
        print(f"{piece:44s} {counts.get(piece, 1):4d} {b:9.2f} {lo:9.2f} {100 * lo / whole:6.1f}%", flush=True)


def transformer_breakdown(rt, prompts, adapter: str, do_bench) -> tuple[dict, dict]:
    """Qwen3-MoE and gpt-oss (MoeTransformer): every layer runs the same pieces. -> (rows, piece -> count)."""
    from lpdiff.engines.logprobs import chunked_logprobs
    from lpdiff.engines.triton.attention import attention
    from lpdiff.engines.triton.batch import Batch
    from lpdiff.engines.triton.moe import experts, route
    from lpdiff.engines.triton.rope import norm_rope_qk

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
        k = qkv[:, m.heads * d : (m.heads + m.kv_heads) * d].view(T, m.kv_heads, d)
        v = qkv[:, (m.heads + m.kv_heads) * d :].view(T, m.kv_heads, d)
        o = torch.randn(T, m.heads * d, dtype=rt.dtype, device=rt.device)
        ids, wts, _ = route(x, lw, cfg, m.impl)

        def moe():  # the runtime's own call: the piece timed below is the one this shape's output came from
            return experts(
                x,
                ids,
                wts,
                lw,
                cfg,
                ll.moe,
                ta,
                m.impl,
                m.moe_backend,
                sum_topk=not m.fuse_topk_sum,
                shrink=m.moe_shrink,
                padding=m.moe_padding,
            )

        moe_out = moe()
        tag = "lora" if slot >= 0 else "base"
        pieces = {
            "add_rms_norm (before attention)": lambda: m._norm(x, x, lw.input_norm, None if xa is None else xa[:, :H]),
            "add_rms_norm (after o)": lambda: m._norm(x, x, lw.post_norm),
            # at TP 1 the MoE's top-k sum is fused into this norm (moe_out is (T, K, H) there)
            "add_rms_norm (moe top-k)": lambda: m._norm(x, moe_out, lw.input_norm),
            "qkv lora_linear": lambda: m.qkv(h, lw, ll, b),
            "norm_rope q+k": lambda: norm_rope_qk(q, k, lw.q_norm, lw.k_norm, cfg.rms_norm_eps, b.cos, b.sin),
            "attention": lambda: attention(q, k, v, b, d**-0.5, cfg.sliding_windows[0], lw.sinks, m.attention_impl),
            "o lora_linear": lambda: m.o_proj(o, lw, ll, b),
            "router+route": lambda: route(x, lw, cfg, m.impl),
            "moe_forward": moe,
        }
        for piece, fn in pieces.items():
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            rows[(piece, tag)] = ms * nl
        sel = torch.arange(T - 1, device=rt.device)
        for fused in (False, True):  # torch fp32 softmax vs the one-pass kernel (kernels/logprob.py)
            rows[(f"logprobs (once{', fused' if fused else ''})", tag)] = do_bench(
                lambda: chunked_logprobs(
                    x[sel], rt.weights.lm_head, b.input_ids[sel + 1], 0, rt.logit_chunk, fused=fused
                ),
                warmup=5,
                rep=50,
                return_mode="median",
            )
        rows[("whole forward", tag)] = do_bench(lambda: m.forward(b), warmup=3, rep=20, return_mode="median")
    return rows, {p: (1 if p.startswith(("logprobs", "whole")) else nl) for p, _ in rows}
