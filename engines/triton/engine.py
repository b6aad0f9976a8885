"""``triton``: lpdiff's own prefill-only MoE-LoRA runtime (see engines/triton/__init__.py for the options)."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch

import lpdiff.engines.triton.tp as tp
from lpdiff.engines.base import AdapterChoice, EngineConfig, check_adapters, per_prompt_adapters
from lpdiff.engines.capabilities import model_type
from lpdiff.engines.progress import progress_log
from lpdiff.engines.triton.capture import capture_layers
from lpdiff.engines.triton.config import SUPPORTED_ARCHS
from lpdiff.engines.triton.options import DEFAULTS, TritonOptions
from lpdiff.engines.triton.routing import run_with_routing
from lpdiff.engines.triton.runtime import Runtime
from lpdiff.engines.triton.shard import Shard
from lpdiff.harness.spec.validate import check_prompt_arrays, model_limits
from lpdiff.harness.types import PromptLogprobs
from lpdiff.kernels import faults


class TritonEngine:
    name = "triton"

    def __init__(self, config: EngineConfig):
        if model_type(config.model.arch) not in SUPPORTED_ARCHS:
            raise ValueError(
                f"the triton engine does not support arch {config.model.arch!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHS)} (use engine 'hf' for other models)"
            )
        self.options = TritonOptions.from_dict(config.options)
        if config.tp not in (1, 2, 4, 8):
            raise ValueError(f"tp must be 1, 2, 4 or 8, got {config.tp}")
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and (self.device.index or 0) + config.tp > torch.cuda.device_count():
            raise ValueError(
                f"tp={config.tp} from {self.device} needs {config.tp} GPUs; {torch.cuda.device_count()} visible"
            )
        self.runtime: Runtime | None = None
        self.workers: tp.Workers | None = None
        self.last_wall_s = 0.0
        self._prev_fault: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> TritonEngine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.runtime is not None:
            return
        check_adapters(self.config, self.name)
        self._prev_fault = faults.activate(self.options.fault)
        world = self.config.tp
        # a TP start on full-width models takes 20-25 s at TP 4 on H100, most of it the workers loading their shards:
        # say which stage
        log = progress_log(f"[triton tp={world}] ") if world > 1 else (lambda msg: None)
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                raise RuntimeError(
                    "a torch.distributed process group already exists in this process; the triton "
                    "engine starts its own for tp > 1 (close the other engine, or use tp=1)"
                )
            self.workers = tp.Workers(world, self.config, self.device, self.options)
            log(f"{world - 1} workers spawned")
        try:
            if self.workers is not None:
                tp.init_group(
                    0, world, self.workers.init_method, tp.rank_device(self.device, 0), self.options.timeout_s
                )
                log("process group joined")
            self.runtime = Runtime(
                self.config, self.options, Shard(0, world), tp.rank_device(self.device, 0), tp.all_reduce_fn(world)
            )
            if self.workers is not None:
                log("rank 0 loaded its shard")
                self.workers.wait_ready()
                log("every rank loaded its shard")
        except BaseException:
            self.close(force=True)
            raise

    def close(self, force: bool = False) -> None:
        if self.workers is not None:
            import torch.distributed as dist

            log = progress_log(f"[triton tp={self.config.tp}] ")
            if not force and self.runtime is not None:
                tp.broadcast(None)  # workers leave their loop and destroy their group
                # NCCL's destroy waits for every rank of the communicator (ncclCommDestroy is collective): rank 0
                # joins the workers in it before it waits for them to exit
                dist.destroy_process_group()
            self.workers.stop(force=force)
            log("workers stopped")
            if dist.is_initialized():
                dist.destroy_process_group()
            self.workers = None
        self.runtime = None
        faults.activate(self._prev_fault)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def version(self) -> str:
        import transformers
        import triton

        opts = self.options
        fault = f", FAULT {opts.fault}" if opts.fault else ""
        moe = f", moe {opts.moe_backend}" if opts.moe_backend != DEFAULTS["moe_backend"] else ""
        return (
            f"lpdiff-triton (impl {opts.impl}{moe}{fault}), torch {torch.__version__}, "
            f"triton {triton.__version__}, transformers {transformers.__version__}"
        )

    # -- work ------------------------------------------------------------------------------------------------
    def capture_layers(self, prompts, adapter=None, inputs=None, steps=()):
        """Per-layer module outputs for lpdiff bisect (engines/triton/capture.py)."""
        return capture_layers(self, prompts, adapter, inputs, steps)

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None, top_k: int = 0
    ) -> list[PromptLogprobs]:
        if self.runtime is None:
            raise RuntimeError("use the engine as a context manager: `with TritonEngine(cfg) as eng:`")
        # check_request's checks, keeping the checked int64 arrays: the runtime packs them with one concatenate
        # (0.45 -> 0.25 ms of an 8 x 512-token call's host time on the H200 machine: check_prompt_array)
        model = self.config.model
        checked = check_prompt_arrays(prompts, *model_limits(model), source=f"prompts for {model.name}")
        names = per_prompt_adapters(adapter, len(checked), self.config.adapters)
        vocab = self.runtime.cfg.vocab_size
        if not 0 <= top_k <= vocab:
            raise ValueError(f"top_k must be in [0, {vocab}], got {top_k}")
        slots = [self.runtime.slot(n) for n in names]
        out: list[PromptLogprobs] = []
        t0 = time.perf_counter()
        for lo, hi in _batches([len(p) for p in checked], self.options.max_batch_tokens):
            msg = (checked[lo:hi], slots[lo:hi], top_k)
            if self.workers is not None:
                tp.broadcast(msg)
            if self.options.capture_routing:
                got = run_with_routing(self.runtime, *msg)
            else:
                got = self.runtime.run(*msg)  # on rank 0 each run ends by waiting for its results: no sync here
            assert got is not None  # rank 0 (this process) gets the results
            out += got
        self.last_wall_s = time.perf_counter() - t0
        return out


def _batches(lens: list[int], max_tokens: int):
    """Consecutive [lo, hi) prompt ranges of at most ``max_tokens`` packed tokens (a longer prompt goes alone)."""
    lo, total = 0, 0
    for i, n in enumerate(lens):
        if i > lo and total + n > max_tokens:
            yield lo, i
            lo, total = i, 0
        total += n
    yield lo, len(lens)
