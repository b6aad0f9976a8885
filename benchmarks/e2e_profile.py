"""benchmarks/bench_e2e.py's looks inside one engine: the host / replay split of a replayed call, the profiler's
top kernels and GPU idle gaps of one call, and the per-piece breakdown of one layer at the benchmark's shapes."""

from __future__ import annotations

import gzip
import statistics
import time
from pathlib import Path

import torch


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


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
    try:
        clock = torch.cuda.clock_rate()
    except Exception as e:  # noqa: BLE001 - nvml may be missing; the split stands without it
        clock = f"n/a ({type(e).__name__})"
    log(
        f"split adapter={adapter}: call {med['call']:.2f} ms, replay+sync {med['replay']:.2f} ms, replay GPU (events) "
        f"{med['replay_gpu']:.2f} ms -> host around the replay {med['call'] - med['replay']:.2f} ms; "
        f"SM clock {clock} MHz"
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


def profile(eng, prompts, adapter, path: Path) -> None:
    """Top CUDA kernels of one call (where the time goes), with ``adapter`` (None: the base call)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

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

    from lpdiff.engines.logprobs import chunked_logprobs
    from lpdiff.engines.triton.attention import attention
    from lpdiff.engines.triton.batch import Batch
    from lpdiff.engines.triton.moe import experts, route
    from lpdiff.engines.triton.rope import norm_rope_qk

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
    print(f"{'piece (x layers)':28s} {'base ms':>9s} {'lora ms':>9s}", flush=True)
    for piece in dict.fromkeys(p for p, _ in rows):
        print(f"{piece:28s} {rows[(piece, 'base')]:9.2f} {rows[(piece, 'lora')]:9.2f}", flush=True)
    return rows
