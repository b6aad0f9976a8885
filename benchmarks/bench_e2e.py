"""End-to-end prompt-logprob throughput: the triton runtime (base and with a rank-32 LoRA on q/k/v/o and every
expert's gate_up/down) against HF+PEFT (engines.hf, grouped_mm experts), measured in the same run on the same GPU,
with peak GPU memory against the runtime's weights + LoRA bytes.

    python -m benchmarks.bench_e2e --models qwen3-30b-a3b gpt-oss-20b --out DIR [--commit SHA] [--layers N]
        [--engines triton hf [vllm sglang]]   # the engines timed, in this order (peers: benchmarks/e2e_peers.py)
        [--moe-backend triton [grouped_mm]]   # the triton engine's moe_backend option(s), each timed in the same
                                              # run (impl column triton / triton+BACKEND)

The timed quantity is prompt-logprob throughput over the same batch (8 x 512 random token ids by default) with the
same adapter, warm (after warm-up calls), median of --reps calls. Each row also says the engine's start-up time
(startup_s: opening the engine, weights built or loaded included) and the settings it ran with; a row of an engine
that cannot serve the model's LoRA holds its error instead of a number. Replayed triton calls split their wall time
(call_ms) from the replay's GPU time between CUDA events recorded around it inside the same calls (gpu_ms): the
difference is the host's time around the replay (staging the ids, fetching the results, Python).

Models are the catalog's full-size configs built on the GPU with the seeded recipe (no downloads); both engines
see the same weights. Rows are appended to DIR/e2e.csv as they are measured (columns of
benchmarks/results/e2e.csv), so a run cut short still leaves what it finished.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.triton.options import ATTENTION
from lpdiff.engines.triton.options import DEFAULTS as OPTIONS
from lpdiff.harness.types import AdapterSpec
from lpdiff.kernels import fused_moe_lora as fm
from lpdiff.kernels.fused_moe_lora import MOE_EXPAND
from lpdiff.kernels.gemm_config import EXPAND
from lpdiff.kernels.moe_grouped import BACKENDS

COLUMNS = [
    "date",
    "commit",
    "gpu",
    "model",
    "tokens",
    "tp",
    "dtype",
    "adapter",
    "impl",
    "tokens_per_s",
    "peak_mem_gb",
    "startup_s",
    "settings",
    "call_ms",
    "gpu_ms",
    "error",
]


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


class ReplayTimer:
    """Stands in for a captured call's CUDA graph while it is timed: each replay inside a real call is bracketed by
    CUDA events, so the GPU time of the replay is read from the same calls as their wall time."""

    def __init__(self, graph):
        self.graph, self.events = graph, []

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))

    def ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self.events]


def timed_split(eng, prompts, adapter, warmup: int, reps: int) -> tuple[float, float, float | None]:
    """timed() for the triton engine, plus the median GPU ms of the replay inside the timed calls (None when the
    layout has no graph: eager variants)."""
    for _ in range(warmup):
        eng.prompt_logprobs(prompts, adapter)
    rt = eng.runtime
    key = rt.layout(prompts, [rt.slot(adapter)] * len(prompts), 0)
    entry = rt.graphs.graphs.get(key) if rt.graphs is not None else None
    if entry is None:
        return (*timed(eng, prompts, adapter, 0, reps), None)
    entry.graph = timer = ReplayTimer(entry.graph)
    try:
        secs, peak = timed(eng, prompts, adapter, 0, reps)
    finally:
        entry.graph = timer.graph
    return secs, peak, statistics.median(timer.ms())


from benchmarks.e2e_profile import breakdown, host_split, profile  # noqa: E402  (they call timed above)


def make_adapter(spec, out_dir: Path, rank: int) -> AdapterSpec:
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import load_hf_model

    model = load_hf_model(spec, torch.bfloat16, "cuda")
    t0 = time.perf_counter()
    ad = generate_adapter(
        model, out_dir, groups=("attention", "experts"), rank=rank, alpha=2 * rank, seed=1, dtype=torch.bfloat16
    )
    log(f"adapter rank {rank} generated in {time.perf_counter() - t0:.1f} s")
    del model
    free_gpu()
    return AdapterSpec(f"r{rank}", ad.path)


def impl_name(
    backend: str,
    graphs: bool,
    shrink: str = OPTIONS["moe_lora_shrink"],
    padding: str = OPTIONS["moe_padding"],
    expand: str = MOE_EXPAND,
    attention: str = OPTIONS["attention"],
) -> str:
    return (
        ("triton" if backend == "triton" else f"triton+{backend}")
        + ("" if graphs else "-eager")
        + ("" if shrink == OPTIONS["moe_lora_shrink"] else f"@{shrink}")
        + ("" if padding == OPTIONS["moe_padding"] else f"@pad:{padding}")
        + ("" if expand == MOE_EXPAND else f"@expand:{expand}")
        + ("" if attention == OPTIONS["attention"] else f"@attn:{attention}")
    )


def bench_model(name: str, args, writer) -> None:
    from benchmarks import e2e_peers
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

        def row(
            adapter_name, impl, secs=None, peak=None, startup_s=None, settings="", call_ms=None, gpu_ms=None, error=""
        ):
            r = make_row(
                args,
                gpu,
                spec.name + (f"-{args.layers}L" if args.layers else ""),
                tokens,
                adapter_name,
                impl,
                secs,
                peak,
                startup_s,
                settings,
                call_ms,
                gpu_ms,
                error,
            )
            writer(r)
            log(r)
            return r

        results, outs = {}, {}
        if "hf" in args.engines:
            t0 = time.perf_counter()
            hf_opts = {"router_margins": False}
            with HFEngine(
                EngineConfig(model=spec, adapters=adapters, dtype="bfloat16", device="cuda", options=hf_opts)
            ) as hf:
                startup = round(time.perf_counter() - t0, 1)
                log(f"hf loaded in {startup} s")
                for a in (None, adapter.name):
                    secs, peak = timed(hf, prompts, a, 1, args.hf_reps)
                    results[("hf", a)] = row(
                        f"r{args.rank}" if a else "none",
                        "hf+peft" if a else "hf",
                        secs,
                        peak,
                        startup,
                        e2e_peers.settings_text(hf_opts, hf.version()),
                    )
                    outs[("hf", a)] = hf.prompt_logprobs(prompts, a)
            free_gpu()
        # CUDA graphs on (the engine's default) and, with --graphs both, off: impl "...-eager"
        # and each --moe-shrink value (the engine's moe_lora_shrink option; impl "...@<value>" unless the default)
        # and each --moe-padding value (moe_padding; impl "...@pad:<value>" unless the default)
        # and each --moe-expand value (fused_moe_lora.MOE_EXPAND while that engine runs; impl "...@expand:<value>"
        # unless the default)
        # and each --attention value (the engine's attention option; impl "...@attn:<value>" unless the default)
        variants = [
            (b, g, sh, pad, ex, at)
            for b in args.moe_backend
            for sh in args.moe_shrink
            for pad in args.moe_padding
            for ex in args.moe_expand
            for at in args.attention
            for g in {"on": (True,), "off": (False,), "both": (True, False)}[args.graphs]
        ]
        if "triton" not in args.engines:
            variants = []
        for backend, graphs, shrink, padding, expand, attn in variants:
            opts = {
                "moe_backend": backend,
                "cuda_graphs": OPTIONS["cuda_graphs"] if graphs else 0,
                "moe_lora_shrink": shrink,
                "moe_padding": padding,
                "attention": attn,
            }
            impl = impl_name(backend, graphs, shrink, padding, expand, attn)
            fm.MOE_EXPAND = expand
            t0 = time.perf_counter()
            with TritonEngine(
                EngineConfig(model=spec, adapters=adapters, dtype="bfloat16", device="cuda", options=opts)
            ) as tr:
                startup = round(time.perf_counter() - t0, 1)
                settings = e2e_peers.settings_text({**opts, "moe_expand": expand})
                wbytes = tr.runtime.weights.nbytes()
                lbytes = tr.runtime.lora.nbytes()
                log(
                    f"{impl} loaded in {startup} s: weights {wbytes / 1e9:.2f} GB, "
                    f"LoRA {lbytes / 1e9:.2f} GB, allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB"
                )
                for a in (None, adapter.name):
                    # 3 warm-up calls: the 2nd captures the layout's CUDA graph, the 3rd is its first replay
                    secs, peak, gpu_ms = timed_split(tr, prompts, a, 3, args.reps)
                    results[(impl, a)] = row(
                        f"r{args.rank}" if a else "none", impl, secs, peak, startup, settings, 1e3 * secs, gpu_ms
                    )
                    if gpu_ms is not None:
                        log(
                            f"{impl} adapter={a}: call {1e3 * secs:.2f} ms = replay GPU {gpu_ms:.2f} ms + host "
                            f"{1e3 * secs - gpu_ms:.2f} ms around it"
                        )
                    outs[(impl, a)] = tr.prompt_logprobs(prompts, a)
                log(
                    f"{impl}: reserved {torch.cuda.max_memory_reserved() / 1e9:.2f} GB at most (allocator pools and "
                    f"graph pools), graphs {tr.runtime.graphs and (tr.runtime.graphs.captures, tr.runtime.graphs.hits)}"
                    " (captures, replays)"
                )
                if args.split and graphs:
                    for a in (None, adapter.name):
                        host_split(tr, prompts, a, args.reps)
                first_variant = (shrink, padding, expand, attn) == (
                    args.moe_shrink[0],
                    args.moe_padding[0],
                    args.moe_expand[0],
                    args.attention[0],
                )
                if args.profile and graphs == (args.graphs != "off") and (first_variant or args.profile_all):
                    stem = f"profile_{name}_{impl}".replace("@", "_").replace(":", "-")  # file names the device returns
                    profile(tr, prompts, adapter.name, Path(args.out) / f"{stem}.txt")
                    profile(tr, prompts, None, Path(args.out) / f"{stem}_base.txt")
                    if first_variant:
                        breakdown(tr, prompts, adapter.name)
            free_gpu()
        fm.MOE_EXPAND = MOE_EXPAND
        peers = [e for e in args.engines if e in e2e_peers.PEERS]
        if peers:
            bench_peers(spec, adapter, prompts, peers, args, Path(tmp), row, results, outs)
    first = impl_name(*variants[0]) if variants else next((k for k, _ in outs), None)
    # the other runs are compared with the first triton variant (or the first engine that ran)
    for a in (None, adapter.name):  # bf16 agreement: noisy on random full-size models, but catches gross errors
        for other in dict.fromkeys(["hf", *e2e_peers.PEERS] + [k for k, _ in outs if k.startswith("triton")]):
            if other != first and (other, a) in outs and (first, a) in outs:
                d = torch.cat(
                    [torch.from_numpy(x.logprobs - y.logprobs) for x, y in zip(outs[(first, a)], outs[(other, a)])]
                )
                log(
                    f"bf16 {first} vs {other} adapter={a}: k2 {0.5 * d.pow(2).mean():.3g}, max |d| "
                    f"{d.abs().max():.3g}, mean |d| {d.abs().mean():.3g}"
                )
    peer_lora = [
        results[(p, adapter.name)]["tokens_per_s"]
        for p in e2e_peers.PEERS
        if results.get((p, adapter.name), {}).get("tokens_per_s") not in (None, "")
    ]
    for impl in (k for k, a in results if k.startswith("triton") and a is None):
        base, lora = results[(impl, None)], results[(impl, adapter.name)]
        summary = {
            "model": spec.name,
            "impl": impl,
            "lora_tok_s": lora["tokens_per_s"],
            "base_tok_s": base["tokens_per_s"],
            "lora_overhead_pct": round(100 * (base["tokens_per_s"] / lora["tokens_per_s"] - 1), 1),
            "peak_over_weights_lora_pct": round(100 * (lora["peak_mem_gb"] * 1e9 / (wbytes + lbytes) - 1), 1),
        }
        if ("hf", adapter.name) in results:
            summary["speedup_vs_hf_peft"] = round(
                lora["tokens_per_s"] / results[("hf", adapter.name)]["tokens_per_s"], 2
            )
        if peer_lora:
            summary["speedup_vs_fastest_peer"] = round(lora["tokens_per_s"] / max(peer_lora), 2)
        log("SUMMARY", summary)


def bench_peers(spec, adapter, prompts, peers, args, work: Path, row, results: dict, outs: dict) -> None:
    """Each peer engine's rows (benchmarks/e2e_peers.py), after the in-process engines gave their GPU memory back;
    the checkpoint is written once for all of them and removed afterwards unless it was there already or
    --keep-checkpoint (a full-depth bf16 Qwen3-30B-A3B is 61 GB: two would not fit a 64 GiB disk)."""
    import shutil

    from benchmarks import e2e_peers

    free_gpu()
    root = Path(args.checkpoint_root)
    before = set(root.iterdir()) if root.is_dir() else set()
    path = None
    try:
        e2e_peers.check_disk(spec, root)
        path = e2e_peers.write_checkpoint_once(spec, root, log)
    except Exception as e:  # noqa: BLE001 - no checkpoint: every peer row carries the error
        import traceback

        traceback.print_exc()
        for engine in peers:
            for a in (None, adapter.name):
                results[(engine, a)] = row(
                    f"r{args.rank}" if a else "none", engine, error=f"checkpoint: {e2e_peers.error_line(e)}"
                )
        return
    free_gpu()

    def peer_row(*a, **kw):
        r = row(*a, **kw)
        results[(r["impl"], adapter.name if r["adapter"] != "none" else None)] = r
        return r

    try:
        for engine in peers:
            got = e2e_peers.bench_peer(engine, spec, adapter, prompts, args, work, timed_any, peer_row, log)
            outs.update({(engine, a): v for a, v in got.items()})
            free_gpu()
    finally:
        if Path(path) not in before and not args.keep_checkpoint:
            shutil.rmtree(path, ignore_errors=True)
            log(f"checkpoint {path} removed (--keep-checkpoint keeps it)")


def timed_any(eng, prompts, adapter, warmup: int, reps: int) -> tuple[float, None]:
    """timed() for an engine whose GPU memory is another process's (a subprocess lane): no peak from here."""
    return timed(eng, prompts, adapter, warmup, reps)[0], None


def make_row(
    args,
    gpu: str,
    model: str,
    tokens: int,
    adapter: str,
    impl: str,
    secs=None,
    peak=None,
    startup_s=None,
    settings: str = "",
    call_ms=None,
    gpu_ms=None,
    error: str = "",
) -> dict:
    """One e2e.csv row; a measurement that did not happen is an empty cell (error says why)."""

    def num(x, nd):
        return "" if x is None else round(x, nd)

    return dict(
        date=datetime.date.today().isoformat(),
        commit=args.commit,
        gpu=gpu,
        model=model,
        tokens=tokens,
        tp=1,
        dtype="bfloat16",
        adapter=adapter,
        impl=impl,
        tokens_per_s="" if secs is None else round(tokens / secs),
        peak_mem_gb=num(peak, 2),
        startup_s=num(startup_s, 1),
        settings=settings,
        call_ms=num(call_ms, 2),
        gpu_ms=num(gpu_ms, 2),
        error=error,
    )


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks import e2e_peers

    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"])
    p.add_argument(
        "--engines",
        nargs="+",
        default=["triton", "hf"],
        choices=e2e_peers.ENGINES,
        help="engines timed, each on the same prompts and adapter: triton, hf (HF and HF+PEFT), and the "
        "peers vllm / sglang (through lpdiff's engine classes; LPDIFF_<ENGINE>_PYTHONPATH points "
        "at an offline bundle)",
    )
    p.add_argument(
        "--engine-options",
        nargs="*",
        default=[],
        metavar="ENGINE=JSON",
        help="a peer's engine options merged over the benchmark's settings (benchmarks/e2e_peers.py "
        'FAST), e.g. vllm=\'{"llm_kwargs": {"enforce_eager": true}}\'',
    )
    p.add_argument(
        "--checkpoint-root",
        default=str(Path.home() / ".cache" / "lpdiff" / "checkpoints"),
        help="where the peers' checkpoint is written (bf16: ~2 bytes per parameter)",
    )
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the peers' checkpoint after the model")
    p.add_argument(
        "--peer-warmup",
        type=int,
        default=2,
        help="warm-up calls of a peer before timing (SGLang compiles kernels in its first batches)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--commit", default="unknown")
    p.add_argument("--layers", type=int, default=None, help="reduced depth (default: full depth)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hf-reps", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="leave hf out of --engines")
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--profile-all", action="store_true", help="with --profile: every shrink/padding variant, not only the first"
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="graph variants: split a call's wall time into the replay and the host work around it",
    )
    p.add_argument(
        "--graphs",
        choices=("on", "off", "both"),
        default="both",
        help="the triton engine's CUDA graphs: on (default option), off (impl '...-eager'), or both timed",
    )
    p.add_argument(
        "--moe-shrink",
        nargs="+",
        default=[OPTIONS["moe_lora_shrink"]],
        help="the triton engine's moe_lora_shrink option(s), each timed in this run (e.g. auto once fused:6,8)",
    )
    p.add_argument(
        "--moe-padding",
        nargs="+",
        default=[OPTIONS["moe_padding"]],
        help="the triton engine's moe_padding option(s), each timed in this run (auto compute zero half)",
    )
    p.add_argument(
        "--moe-expand",
        nargs="+",
        default=[MOE_EXPAND],
        choices=EXPAND,
        help="where the expert GEMMs' LoRA expand runs (GemmConfig.expand, kernels/fused_moe_lora.py "
        "EXPAND): the K-loop's first step (loop, the default), before the K-loop (first) or in the "
        "epilogue (last); each timed in this run",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        default=[OPTIONS["attention"]],
        choices=ATTENTION,
        help="the triton engine's attention option(s) (engines/triton/attention.py), each timed in this run",
    )
    p.add_argument(
        "--moe-backend",
        nargs="+",
        default=["triton"],
        choices=BACKENDS,
        help="the triton engine's moe_backend option(s) (kernels/moe_grouped.py), each timed in this run",
    )
    args = p.parse_args(argv)
    args.engines = list(dict.fromkeys(e for e in args.engines if not (args.skip_hf and e == "hf")))
    try:
        args.engine_options = e2e_peers.parse_engine_options(args.engine_options)
    except ValueError as e:
        p.error(str(e))  # exit 2 with the usage line
    return args


def open_csv(path: Path):
    """``path`` opened for appending rows of COLUMNS. A file written with an older, shorter header (a prefix of
    COLUMNS) is rewritten first with the new columns, its rows' new cells empty; any other header is refused."""
    if path.exists():
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        header = rows[0] if rows else []
        if header != COLUMNS:
            if header != COLUMNS[: len(header)]:
                print(
                    f"{path} has columns {header}, not a prefix of {COLUMNS}: write to another --out (nothing "
                    "was changed)",
                    file=sys.stderr,
                )
                raise SystemExit(2)
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(COLUMNS)
                w.writerows(r + [""] * (len(COLUMNS) - len(r)) for r in rows[1:])
            os.replace(tmp, path)
    new = not path.exists() or path.stat().st_size == 0
    f = open(path, "a", newline="")  # noqa: SIM115 (returned open: main writes rows to it under `with f`)
    w = csv.DictWriter(f, fieldnames=COLUMNS)
    if new:
        w.writeheader()
    return f, w


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    f, w = open_csv(Path(args.out) / "e2e.csv")
    with f:

        def writer(r):
            w.writerow(r)
            f.flush()

        for name in args.models:
            try:
                bench_model(name, args, writer)
            except Exception as e:  # noqa: BLE001 (one model failing must not lose the other's numbers)
                import traceback

                traceback.print_exc()
                log(f"{name} FAILED: {e!r}")


if __name__ == "__main__":
    main()
