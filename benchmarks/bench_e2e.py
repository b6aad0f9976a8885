"""End-to-end prompt-logprob throughput: the triton runtime (base and with a rank-32 LoRA on q/k/v/o and every
expert's gate_up/down) against HF+PEFT (engines.hf, grouped_mm experts), measured in the same run on the same GPU,
with peak GPU memory against the runtime's weights + LoRA bytes.

    python -m benchmarks.bench_e2e --models qwen3-30b-a3b gpt-oss-20b --out DIR [--commit SHA] [--layers N]
        [--engines triton hf [vllm sglang]]   # the engines timed, in this order (peers: benchmarks/e2e_peers.py)
        [--moe-backend triton [grouped_mm]]   # the triton engine's moe_backend option(s), each timed in the same
                                              # run (impl column triton / triton+BACKEND)
        [--breakdown] [--profile]             # each piece of one layer of each kind, x its layers (e2e_profile.py,
                                              # e2e_hybrid.py for Qwen3.5 and Nemotron-H); the profiler's top kernels
        [--deadline-s S] [--checkpoint-root R1 [R2 ...]]   # peers not started past S; their checkpoint's disk

All four families: Nemotron-3-Super runs at the depth whose weights + LoRA fit one H200 (43 of 88 layers,
benchmarks/sol_hybrid.FIT_GB) unless --layers; a runtime that captures no CUDA graph (the hybrids' today, and any on
a CPU) is timed once, its rows named "-eager". One model's run is benchmarks/e2e_run.py; an engine that fails to
start or serve leaves its error in its rows and the call goes on. On a CPU (no GPU here) the same path runs on the
tiny zoo with --dtype float32 and small --batch/--seq/--reps, peak-memory cells empty.

The timed quantity is prompt-logprob throughput over the same batch (8 x 512 random token ids by default) with the
same adapter, warm (after warm-up calls), median of --reps calls. Each row also says the engine's start-up time
(startup_s: opening the engine, weights built or loaded included) and the settings it ran with; a row of an engine
that cannot serve the model's LoRA holds its error instead of a number. Replayed triton calls split their wall time
(call_ms) from the replay's GPU time between CUDA events recorded around it inside the same calls (gpu_ms): the
difference is the host's time around the replay (staging the ids, fetching the results, Python), logged split into
before the launch, the launch and after the replay (host_split).

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
import time
from pathlib import Path

import torch

from lpdiff.engines.triton.options import ATTENTION, MAMBA_SCAN
from lpdiff.engines.triton.options import DEFAULTS as OPTIONS
from lpdiff.kernels.fused_moe_lora import MOE_BLOCK_M, MOE_EXPAND, MOE_N_TAIL
from lpdiff.kernels.gemm_config import EXPAND
from lpdiff.kernels.moe_grouped import BACKENDS

# the expert GEMMs' module knobs (fused_moe_lora.MOE_EXPAND, MOE_BLOCK_M, MOE_N_TAIL) as a variant carries them
KERNEL_DEFAULTS = (MOE_EXPAND, MOE_BLOCK_M, MOE_N_TAIL)

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


# CUDA's clocks and memory counters where there is a GPU; on a CPU (the tiny zoo's end-to-end checks) the timing runs
# the same way and the peak-memory cells stay empty
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def free_gpu():
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if CUDA else None


def timed(eng, prompts, adapter, warmup: int, reps: int, calls: list | None = None) -> tuple[float, float | None]:
    """-> (median seconds per call, peak GB allocated during the timed calls; None without a GPU). ``calls``: each
    timed call's (start, end) perf_counter seconds are appended to it."""
    for _ in range(warmup):
        eng.prompt_logprobs(prompts, adapter)
    sync()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        eng.prompt_logprobs(prompts, adapter)
        sync()
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        if calls is not None:
            calls.append((t0, t1))
    return statistics.median(walls), peak_gb()


class ReplayTimer:
    """Stands in for a captured call's CUDA graph while it is timed: each replay inside a real call is bracketed by
    CUDA events, so the GPU time of the replay is read from the same calls as their wall time."""

    def __init__(self, graph):
        self.graph, self.events, self.launches = graph, [], []

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        self.graph.replay()
        end.record()
        self.launches.append((t0, time.perf_counter()))  # the host's side of the launch (host_split)
        self.events.append((start, end))

    def ms(self) -> list[float]:
        sync()
        return [s.elapsed_time(e) for s, e in self.events]


def timed_split(eng, prompts, adapter, warmup: int, reps: int) -> tuple[float, float, float | None, dict | None]:
    """timed() for the triton engine, plus the median GPU ms of the replay inside the timed calls and where the
    host's time around it goes (host_split); both None when the layout has no graph (eager variants)."""
    for _ in range(warmup):
        eng.prompt_logprobs(prompts, adapter)
    rt = eng.runtime
    key = rt.layout(prompts, [rt.slot(adapter)] * len(prompts), 0)
    entry = rt.graphs.graphs.get(key) if rt.graphs is not None else None
    if entry is None:
        return (*timed(eng, prompts, adapter, 0, reps), None, None)
    entry.graph = timer = ReplayTimer(entry.graph)
    calls: list = []
    try:
        secs, peak = timed(eng, prompts, adapter, 0, reps, calls)
    finally:
        entry.graph = timer.graph
    gpu = timer.ms()
    return secs, peak, statistics.median(gpu), host_split(calls, timer.launches, gpu)


def host_split(calls: list, launches: list, gpu_ms: list) -> dict | None:
    """Where a replayed call's host time goes, medians in ms over calls with one replay each (None otherwise):
    "before" the replay's launch (checks, layout, staging the ids: the GPU is idle then), the "launch" itself
    (cudaGraphLaunch; the GPU starts on the graph while it runs), and "after": what is left of the call once the
    replay's GPU time is counted from the launch on (fetching the results, Python)."""
    if not calls or len(calls) != len(launches) or len(calls) != len(gpu_ms):
        return None
    before, launch, after = [], [], []
    for (c0, c1), (l0, l1), g in zip(calls, launches, gpu_ms, strict=True):
        before.append(1e3 * (l0 - c0))
        launch.append(1e3 * (l1 - l0))
        after.append(1e3 * (c1 - l0) - g)
    return {k: round(statistics.median(v), 3) for k, v in (("before", before), ("launch", launch), ("after", after))}


def impl_name(
    backend: str,
    graphs: bool,
    shrink: str = OPTIONS["moe_lora_shrink"],
    padding: str = OPTIONS["moe_padding"],
    attention: str = OPTIONS["attention"],
    scan: str = OPTIONS["mamba_scan"],
    kernel: tuple = KERNEL_DEFAULTS,
) -> str:
    """A triton variant's impl column; kernel: its (MOE_EXPAND, MOE_BLOCK_M, MOE_N_TAIL) (e2e_run.set_kernel_knobs)."""
    expand, block_m, n_tail = kernel
    return (
        ("triton" if backend == "triton" else f"triton+{backend}")
        + ("" if graphs else "-eager")
        + ("" if shrink == OPTIONS["moe_lora_shrink"] else f"@{shrink}")
        + ("" if padding == OPTIONS["moe_padding"] else f"@pad:{padding}")
        + ("" if expand == MOE_EXPAND else f"@expand:{expand}")
        + ("" if attention == OPTIONS["attention"] else f"@attn:{attention}")
        + ("" if scan == OPTIONS["mamba_scan"] else f"@scan:{scan}")
        + ("" if block_m is None else f"@bm:{block_m}")
        + ("" if n_tail else "@ntail:off")
    )


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
        dtype=getattr(args, "dtype", "bfloat16"),
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
        nargs="+",
        default=[str(Path.home() / ".cache" / "lpdiff" / "checkpoints")],
        help="where the peers' checkpoint is written (bf16: ~2 bytes per parameter): the first of these with room "
        "for it (e.g. /dev/shm/lpdiff ~/.cache/lpdiff/checkpoints)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds from the start of this call: a peer (start-up, warm-up and timed calls: e2e_peers.PEER_S) "
        "that could not finish before it is not started, its rows say so (a device call's limit is 600 s)",
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
    p.add_argument("--profile", action="store_true", help="profile the first variant's calls; implies --breakdown")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="time each piece of one layer of each kind at the call's shapes, x its layers (e2e_profile.breakdown)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the engines' dtype (bf16 on the GPU; float32 for a CPU check of the tiny zoo)",
    )
    p.add_argument(
        "--profile-all", action="store_true", help="with --profile: every shrink/padding variant, not only the first"
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="graph variants: the call's graph replayed alone back to back beside the whole calls, and a cProfile "
        "of one call (e2e_profile.bare_replays)",
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
        "--moe-block-m",
        nargs="+",
        type=lambda v: None if v == "auto" else int(v),
        default=[None],
        choices=[None, 16, 32, 64, 128],
        metavar="{auto,16,32,64,128}",
        help="the expert GEMMs' routing block (kernels/fused_moe_lora.py MOE_BLOCK_M; auto = default_config's "
        "rows heuristic), each timed in this run (impl ...@bm:<value>)",
    )
    p.add_argument(
        "--moe-n-tail",
        nargs="+",
        default=["on"],
        choices=("on", "off"),
        help="the expert GEMMs' last N tile no wider than the columns left (kernels/fused_moe_lora.py MOE_N_TAIL, "
        "GemmConfig.n_tail), each timed in this run",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        default=[OPTIONS["attention"]],
        choices=ATTENTION,
        help="the triton engine's attention option(s) (engines/triton/attention.py), each timed in this run",
    )
    p.add_argument(
        "--mamba-scan",
        nargs="+",
        default=[OPTIONS["mamba_scan"]],
        choices=MAMBA_SCAN,
        help="Nemotron-H: the triton engine's mamba_scan option(s) (engines/triton/mamba.py), each timed in this run "
        "(impl ...@scan:<value>; auto = mamba_ssm's chunked kernels in bf16 on a GPU); other models run the default",
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
    from benchmarks.e2e_run import bench_model

    args = parse_args(argv)
    args.started = time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    Path(args.out).mkdir(parents=True, exist_ok=True)
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
