"""``sglang``: prompt logprobs from SGLang, through its offline ``sgl.Engine`` (always inside a subprocess lane) or
its HTTP ``/generate`` API (a server lpdiff launches, or one already running).

Written for SGLang 0.5.15 and checked line by line against its source (file:line below are in python/sglang/srt/ of
0.5.15); not run from this file on a GPU yet. Tested without SGLang (tests/test_sglang_engine.py): the launch
settings, the request, the response parsing, the HTTP client against a local stand-in server, and that a dying
engine or server becomes an error carrying its log tail.

Requests: ``input_ids`` (token-id prompts; ``skip_tokenizer_init=True``), ``sampling_params={"max_new_tokens": 0}``
(0 is allowed, sampling/sampling_params.py:209, and makes the request prefill-only), ``return_logprob=True``,
``logprob_start_len=0``, ``top_logprobs_num=k``, ``lora_path=[name or None per prompt]`` (adapters registered at
start as ``lora_paths={name: path}``, server_args.py:6816; requests pick them by name). Responses: 
``meta_info["input_token_logprobs"]`` = [(logprob, token_id, None)] per prompt token (text is None without
return_text_in_logprobs, managers/tokenizer_manager.py:2302), the first logprob None ([None] + logprobs[:-1],
managers/scheduler_components/logprob_result_processor.py:37); token ids >= vocab_size - 1 come back as 0
(logprob_result_processor.py:53, meant for image-token hashes). ``meta_info["input_top_logprobs"]``: None at
position 0, then a list of (logprob, token_id, None) per position.

Why a lane: a PEFT 3D expert adapter kills SGLang 0.5.15's engine at the first LoRA request: its LoRAConfig reads
target_modules only (lora/lora_config.py:42), the 3D expert tensors match no LoRA target, are "skipped"
(lora/mem_pool.py:807) and then raise ValueError in the scheduler (lora/mem_pool.py:848). In the lane that becomes a
LaneDied error with the engine's last log lines (convert the adapter: ``lpdiff adapters convert --to per_expert``).
``Engine.shutdown()`` kills SGLang's scheduler/detokenizer processes and waits for them (entrypoints/engine.py:925);
the lane then ends its whole process group (SGLang starts no process in a session of its own), so the GPU is free
for the next lane (e.g. TP 2 after TP 1).

Settings (MOE_LORA_SETTINGS) are the ones that ran MoE-LoRA on 0.5.15: triton attention, LoRA and MoE runner,
pytorch sampling, no grammar backend, no CUDA graph, no radix cache (every prompt computed in full), no server
warmup. moe_runner_backend must be "triton": MoE LoRA refuses other runners (lora/layers.py:954), and for bf16
gpt-oss SGLang would otherwise pick "triton_kernel" (arg_groups/overrides.py:566). LoRA target modules are inferred
from the adapters' target_modules lists (lora/lora_manager.py:582); the experts get LoRA only when the union names
gate/up_proj and down_proj (lora/lora_manager.py:845). max_loras_per_batch counts the base model as one adapter
(lora/lora_manager.py:277), so it is sized for every adapter plus base in one batch. SGLang has no fp32 path
(sgl_kernel rmsnorm): bf16/fp16 only. mem_fraction_static 0.5: prompt logprobs need the whole batch's
full-vocabulary logits at once (layers/logits_processor.py), which SGLang's default static fraction leaves no room
for: gpt-oss-20b (vocab 201088), 4 layers, 48 prompts x ~150 tokens went out of memory asking 5.5 GiB beside a
120 GB KV cache on an H200 (docs/engines.md, SGLang).

The model checkpoint (config-built or layer-cut models) is written by the caller's process, with the caller's
transformers, so that SGLang loads exactly the weights the HF reference builds (the SGLang bundle pins its own
transformers, whose initialisation may differ); the lane gets the finished ServerArgs.

Options (``EngineConfig.options``):
  mode               "offline" (default) | "http"
  url                http mode: a running server (its adapters must be loaded under the names used here);
                     without it lpdiff launches ``python -m sglang.launch_server`` with the same settings
  server_args        dict of ServerArgs fields merged over lpdiff's settings (e.g. {"mem_fraction_static": 0.5})
  python             the interpreter that has SGLang (offline lane and launched server); lane_env,
                     lane_start_timeout_s, lane_call_timeout_s, lane_log as in engines.subprocess_lane
  port               launched server's port (default: a free one); request_timeout_s (default: scaled from the
                     request's tokens like a lane call, see LaneConfig.call_timeout)
  checkpoint_dir     where a config-built or layer-cut model is written for SGLang to load
"""
from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from lpdiff.engines.base import AdapterChoice, EngineConfig, check_request
from lpdiff.engines.subprocess_lane import (LaneConfig, LaneEngine, ManagedProcess, lane_config_from_options,
                                     strip_lane_options)
from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode, model_type
from lpdiff.harness.types import PromptLogprobs

MOE_LORA_SETTINGS: dict[str, Any] = {
    "attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
    "moe_runner_backend": "triton", "lora_backend": "triton",
    "disable_cuda_graph": True, "disable_radix_cache": True, "skip_server_warmup": True,
    "mem_fraction_static": 0.5,
}
# Per model type, over MOE_LORA_SETTINGS. Nemotron-H: server_args asserts against triton attention for it and the
# offline bundle has no FA3 (flash_ops, 1.76 GB), so torch_native (SDPA). Hybrids with a shared expert: SGLang's
# own LoRA tests for Qwen3.5 / Nemotron-H disable shared-expert fusion (the fused kernel would carry the shared
# expert's LoRA as a routed expert's).
# Nemotron-H: lora_target_modules=["all"] gives the shared expert / MLP up_proj their own LoRA buffer (an adapter's
# up_proj target alone is renamed gate_up_proj and its tensors then match nothing, lora/utils.py:255, :407).
# Qwen3.5: the checkpoint is multimodal, and with multimodal on SGLang loads an image processor even with
# skip_tokenizer_init (managers/tokenizer_manager.py:331); token-id prompts need none (launch_server's flags cannot
# turn it off: it is a store_true, so the HTTP mode needs the checkpoint's processor files)
ARCH_SETTINGS: dict[str, dict[str, Any]] = {
    "nemotron_h": {"attention_backend": "torch_native", "disable_shared_experts_fusion": True,
                   "lora_target_modules": ["all"]},
    "qwen3_5_moe": {"disable_shared_experts_fusion": True, "enable_multimodal": False},
}
_OWN_OPTIONS = ("mode", "url", "server_args", "port", "request_timeout_s", "checkpoint_dir")
_RESOLVED = "_resolved"  # option the parent hands the lane: {"server_args": ..., "vocab_size": ...}
_NOT_INSTALLED = ("sglang is not installed for {python}: install sglang==0.5.15 (or unpack the offline bundle from "
                  "gpu-bundles/sglang-0.5.15.sh and put it on PYTHONPATH), or pass options python=<interpreter "
                  "that has SGLang>")

_V = "SGLang 0.5.15"  # file:line below are in python/sglang/srt/ of this version
_FIX_QV = "add q_proj and v_proj to the adapter (zero lora_B keeps its math)"

CAPABILITIES = Capabilities(
    engine="sglang", label="SGLang", versions=_V, archs=("qwen3_moe", "gpt_oss", "qwen3_5_moe", "nemotron_h", "qwen3"),
    layouts=("peft3d", "per_expert"), arch_layouts=(("nemotron_h", ("peft3d", "per_expert_gate")),),
    dtypes=("bfloat16", "float16"), lora_fp32=False,  # no fp32 path (rmsnorm)
    max_rank=None, max_moe_rank=None, tp=(1, 2, 4, 8), router_lora="refused",
    # utils/common.py:3985 SUPPORTED_LORA_TARGET_MODULES; any other name has no get_hidden_dim entry
    # (lora/utils.py:224) and the engine fails to start
    lora_targets=frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                            "gate_up_proj", "embed_tokens", "lm_head"}),
    # the hybrids' own LoRA modules, as adapter leaf names: Qwen3.5 supported_lora_modules (models/qwen3_5.py:1116)
    # with get_hidden_dim entries (:1126-1173; q_proj carries the output gate, :1130); HF's GDN names in_proj_qkv,
    # in_proj_z, in_proj_b, in_proj_a keep their names (lora/utils.py:274-278) and have none. Nemotron-H:
    # models/nemotron_h.py:861-871 and get_hidden_dim :965-1048 (gate_proj/x_proj: lora/lora.py:286)
    arch_lora_targets=(
        ("qwen3_5_moe", frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "out_proj", "in_proj_qkvz",
                                   "gate_proj", "up_proj", "down_proj", "gate_up_proj", "embed_tokens", "lm_head"})),
        ("nemotron_h", frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "out_proj", "in_proj",
                                  "gate_proj", "x_proj", "up_proj", "down_proj", "gate_up_proj", "fc1_latent_proj",
                                  "fc2_latent_proj", "embed_tokens", "lm_head"}))),
    # lora/lora_config.py:42-45 reads r, lora_alpha, target_modules and use_dora only; lora/lora.py:71 scales alpha/r
    ignored_features=("rank_pattern", "alpha_pattern", "use_rslora"),
    modes=(Mode("cuda_graphs_on", {"server_args": {"disable_cuda_graph": False}}, ("cuda",)),
           Mode("chunked_prefill_64", {"server_args": {"chunked_prefill_size": 64}}, ("cuda",)),
           Mode("lora_backend_csgmv", {"server_args": {"lora_backend": "csgmv"}}, ("cuda",))),
    known_defects=(
        KnownDefect("peft3d-kills-sglang", "PEFT 3D expert adapter: SGLang 0.5.15 ignores target_parameters, 'skips' "
                    "the expert tensors and its scheduler dies at the first LoRA request (lora/mem_pool.py:807, :848)",
                    "convert it to the per-expert layout: {to_per_expert}", _V, layouts=("peft3d",)),
        KnownDefect("router-target", "LoRA on the MoE router ({where}) is not supported by SGLang 0.5.15: it wraps "
                    "the router but has no LoRA shape for it, so the engine fails to start (lora/utils.py:224 "
                    "get_hidden_dim NotImplementedError)", "{router_fix}", _V, when="LoRA on the MoE router"),
        # q/k/v LoRA is fused into qkv_proj, which needs q_proj and v_proj (a missing k_proj gets zeros)
        KnownDefect("q-without-v", "the adapter targets q_proj but not v_proj: SGLang fails to load it (KeyError on "
                    "v_proj while fusing q/k/v)", "add v_proj to the adapter (a zero lora_B for v_proj keeps its math)",
                    _V, when="q_proj without v_proj (lora/lora.py:245)"),
        KnownDefect("kv-without-q", "the adapter targets {qkv} without q_proj: SGLang loads it, then its scheduler "
                    "dies at the first LoRA request (the k/v tensors match no fused qkv target)", _FIX_QV, _V,
                    when="k_proj or v_proj without q_proj (lora/mem_pool.py:848)"),
        KnownDefect("sglang-experts-half-targeted", "the adapter's expert LoRA covers {parts} but not {missing}: "
                    "SGLang puts LoRA on the experts only when gate/up and down are both targeted, so its expert part "
                    "is silently dropped (unless an adapter loaded beside it targets both)",
                    "add {missing} to the adapter's experts (zero lora_B keeps its math)", _V,
                    layouts=("per_expert",), when="gated experts, not both gate/up and down (lora_manager.py:845)"),
        # lora/layers.py:1176 interleaves gate/up's B; lora_moe_runners.py:342-345 and
        # triton_ops/fused_moe_lora_kernel.py:407 still apply gate's A to the first half of the rows, up's A to the
        # second: right only when they share one A (as PEFT's fused gate_up_proj LoRA does)
        KnownDefect("sglang-gpt-oss-gate-up-a", "{differ} gpt-oss expert(s) have different lora_A for gate_proj and "
                    "up_proj: SGLang 0.5.15 pairs them with the wrong half of gpt-oss's interleaved gate/up rows and "
                    "computes a different delta (silently)",
                    "give gate_proj and up_proj one shared lora_A per expert (PEFT's fused layout)", _V,
                    archs=("gpt_oss",), layouts=("per_expert",), when="gate_proj and up_proj lora_A differ"),
        KnownDefect("sglang-target-modules-string", "target_modules is the pattern {pattern}: SGLang 0.5.15 accepts "
                    "only a list of module names (or 'all-linear') and refuses to start",
                    "save target_modules as a list of module names", _V,
                    when="target_modules is a regex string (lora/lora_manager.py:576)"),
        KnownDefect("sglang-unsupported-target", "SGLang has no LoRA support for {bad} (0.5.x supports {supported}): "
                    "the adapter fails to load", "drop {bad} from the adapter to run it on SGLang", _V,
                    when="a target outside lora_targets"),
        KnownDefect("sglang-unsupported-target", "SGLang 0.5.15 has no LoRA for {bad} on {arch} (its LoRA modules "
                    "there: {supported}); HF's GDN names keep their names and have no get_hidden_dim entry, so the "
                    "engine fails to start (models/qwen3_5.py:1171, sglang#30168)",
                    "drop {bad}: SGLang reads the GDN input projection only as the fused in_proj_qkvz "
                    "(lora/lora.py:309) and has no LoRA for in_proj_b / in_proj_a at all", _V,
                    archs=("qwen3_5_moe",), when="a target outside the arch's LoRA modules"),
        KnownDefect("sglang-unsupported-target", "SGLang 0.5.15 has no LoRA for {bad} on {arch} (its LoRA modules "
                    "there: {supported}): the engine fails to start (models/nemotron_h.py:1046 get_hidden_dim)",
                    "drop {bad} from the adapter to run it on SGLang", _V, archs=("nemotron_h",),
                    when="a target outside the arch's LoRA modules"),
        # target up_proj -> gate_up_proj (lora/utils.py:255), up_proj tensors keep their name (lora/lora.py:396):
        # no target at lora/mem_pool.py:848 (lora/utils.py:319). Non-gated experts read experts.{e}.gate_proj as the
        # unstacked gate_up_proj (lora/lora.py:370-377, models/nemotron_h.py:956); lora_target_modules=["all"] keeps
        # the model's up_proj (lora/utils.py:407) for shared expert / MLP, not for experts (no up_proj_moe buffer)
        KnownDefect("sglang-nemotron-up-proj", "LoRA on the routed experts' up_proj ({where}): SGLang 0.5.15 "
                    "renames the target to gate_up_proj but not the tensors, and its scheduler dies at the first "
                    "LoRA batch ('Cannot find target module name for ...up_proj.lora_A.weight', lora/mem_pool.py:848;"
                    " measured on Nemotron-Nano)", "rename each experts.N.up_proj to experts.N.gate_proj, which "
                    "SGLang reads as the non-gated expert input (lora/lora.py:370): {to_per_expert_gate}", _V,
                    archs=("nemotron_h",), when="per-expert tensors for experts.N.up_proj"),
        KnownDefect("sglang-nemotron-shared-up-proj", "LoRA on up_proj outside the routed experts ({where}): SGLang "
                    "0.5.15 started without lora_target_modules=['all'] renames the target to gate_up_proj and its "
                    "scheduler dies at the first LoRA batch (lora/utils.py:255)", "lpdiff's sglang engine starts it "
                    "with lora_target_modules=['all'] (lora/utils.py:407); do the same when serving it", _V,
                    archs=("nemotron_h",), severity="info", when="tensors for a shared-expert or MLP up_proj"),
        # in_proj's LoRA buffers hold z and x only: A 2r rows (stacked_multiply 2, lora/utils.py:296), B
        # 2 * mamba intermediate rows (models/nemotron_h.py:1019-1022); a PEFT in_proj A (r rows) or B (z, x, B, C,
        # dt rows) fails load_lora_weight_tensor's shape assert (lora/mem_pool.py:772) at the first LoRA batch;
        # the form it reads is a gate_proj (z) + x_proj (x) pair stacked into in_proj (lora/lora.py:286-307)
        KnownDefect("sglang-mamba-in-proj", "mamba in_proj LoRA ({where}): SGLang 0.5.15 holds LoRA for in_proj's z "
                    "and x slices only (A of 2r rows, B of 2 x mamba intermediate rows); a PEFT in_proj LoRA does not "
                    "fit that buffer and the first LoRA batch fails a shape assert (lora/mem_pool.py:772; measured "
                    "on Nemotron-Nano: 'LoRA buffer shape [32, 2688] does not match weight shape [16, 2688]')", "for SGLang save it as mixer.gate_proj (z rows of B) + mixer.x_proj (x rows) with "
                    "target_modules ['in_proj'] (lora/lora.py:286), possible only where B's B/C/dt rows are zero; "
                    "else judge the mamba group on vLLM or HF+PEFT", _V, archs=("nemotron_h",),
                    when="tensors for the mamba mixer's in_proj"),
        KnownDefect("sglang-ignores-scaling", "SGLang (0.5.15 source) ignores {features}: those modules get alpha/r "
                    "scaling instead of PEFT's", "re-save the adapter with one rank and alpha and no rsLoRA (the "
                    "scaling folded into B)", _V, severity="warning", when="an ignored_features entry is set"),
        # SGLang picks "triton_kernel" for bf16 gpt-oss (arg_groups/overrides.py:566); MoE LoRA refuses it
        # (lora/layers.py:954)
        KnownDefect("sglang-gpt-oss-runner", "gpt-oss LoRA on SGLang needs moe_runner_backend='triton': SGLang picks "
                    "'triton_kernel' for bf16 gpt-oss by default (arg_groups/overrides.py:566) and its MoE LoRA "
                    "refuses that runner (lora/layers.py:954)", "lpdiff's sglang engine sets it", _V,
                    archs=("gpt_oss",), severity="info"),
    ))

# -- settings, requests, responses (pure: tested without SGLang) ---------------------------------------------------

def server_args(config: EngineConfig, model_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """ServerArgs fields (the keyword arguments of ``sgl.Engine``) for this config."""
    from lpdiff.harness.spec.adapters import adapter_max_rank

    if config.dtype == "float32":
        raise ValueError("SGLang has no fp32 path (sgl_kernel's rmsnorm takes bf16/fp16): use dtype bfloat16 and "
                         "compare against an fp32 reference")
    # log_level: sgl.Engine defaults to "error", which would hide the LoRA loading lines ("loaded weights for
    # target modules", "weight(s) skipped") that the lane's log tail should carry when something goes wrong
    args: dict[str, Any] = {"model_path": model_path, "skip_tokenizer_init": True, "dtype": config.dtype,
                            "tp_size": config.tp, "random_seed": 0, "log_level": "info", **MOE_LORA_SETTINGS,
                            **ARCH_SETTINGS.get(model_type(config.model.arch), {})}
    if config.adapters:
        args.update(enable_lora=True, lora_paths={n: str(a.path) for n, a in config.adapters.items()},
                    max_lora_rank=max(adapter_max_rank(a.path) for a in config.adapters.values()),
                    max_loras_per_batch=len(config.adapters) + 1)  # + the base model's slot
    args.update(overrides or {})
    return args


def server_cli(args: dict[str, Any]) -> list[str]:
    """ServerArgs fields -> ``sglang.launch_server`` flags: True -> --flag, False/None -> omitted, a dict of
    lora_paths -> name=path items, lists -> several values."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, dict):
            out += [flag, *(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, (list, tuple, set)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def sglang_top_k(top_k: int, vocab_size: int) -> int:
    """The engine protocol's top_k -> SGLang's top_logprobs_num (no -1 there: the whole vocabulary is its size)."""
    if top_k < -1:
        raise ValueError(f"top_k must be -1 (whole vocabulary), 0 or positive, got {top_k}")
    return vocab_size if top_k == -1 else min(top_k, vocab_size)


def generate_request(prompts: Sequence[Sequence[int]], names: Sequence[str | None], top_k: int,
                     vocab_size: int) -> dict[str, Any]:
    """One batched /generate request (also the keyword arguments of ``Engine.generate``)."""
    req: dict[str, Any] = {"input_ids": [[int(t) for t in p] for p in prompts],
                           "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                           "return_logprob": True, "logprob_start_len": 0}
    k = sglang_top_k(top_k, vocab_size)
    if k:
        req["top_logprobs_num"] = k
    if any(n is not None for n in names):
        req["lora_path"] = list(names)
    return req


def parse_response(token_ids: Sequence[int], item: dict[str, Any], top_k: int = 0,
                   vocab_size: int | None = None) -> PromptLogprobs:
    """One element of SGLang's answer -> PromptLogprobs (``top_k`` as given to generate_request: 0, k or -1).
    ``vocab_size``: the model's; SGLang reports token ids >= vocab_size - 1 as 0, which is then not a mismatch."""
    n = len(token_ids)
    meta = item.get("meta_info") if isinstance(item, dict) else None
    entries = meta.get("input_token_logprobs") if meta else None
    if entries is None:
        raise ValueError("SGLang returned no meta_info.input_token_logprobs: the request needs return_logprob=True "
                         "and logprob_start_len=0")
    if len(entries) != n:
        raise ValueError(f"SGLang returned {len(entries)} input logprobs for a prompt of {n} tokens "
                         "(logprob_start_len must be 0)")
    want_ids = [int(t) for t in token_ids]
    if vocab_size is not None:  # logprob_result_processor.py:53 clips these ids to 0
        want_ids = [0 if t >= vocab_size - 1 else t for t in want_ids]
    got_ids = [int(e[1]) for e in entries]
    if got_ids != want_ids:
        bad = next(i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b)
        raise ValueError(f"SGLang's logprobs are for other tokens (position {bad}: {got_ids[bad]} != "
                         f"{token_ids[bad]}); run it with skip_tokenizer_init=True and token-id prompts")
    if any(e[0] is None for e in entries[1:]):
        raise ValueError("SGLang returned None logprobs past the first position")
    lp = np.asarray([e[0] for e in entries[1:]], dtype=np.float32)
    tk_ids = tk_lp = None
    if top_k:
        tops = meta.get("input_top_logprobs")
        if tops is None or len(tops) != n:
            raise ValueError("SGLang returned no input_top_logprobs for every position: the request needs "
                             "top_logprobs_num")
        ids_rows, lp_rows = [], []
        for i, row in enumerate(tops[1:], start=1):
            row = sorted(row or [], key=lambda e: -e[0])
            k = len(row) if top_k == -1 else top_k
            if len(row) < k:
                raise ValueError(f"asked for top {k} logprobs, SGLang returned {len(row)} at position {i}")
            ids_rows.append([int(e[1]) for e in row[:k]])
            lp_rows.append([e[0] for e in row[:k]])
        tk_ids, tk_lp = np.asarray(ids_rows, dtype=np.int64), np.asarray(lp_rows, dtype=np.float32)
    return PromptLogprobs(token_ids=np.asarray(token_ids, dtype=np.int64), logprobs=lp, topk_ids=tk_ids,
                          topk_logprobs=tk_lp)


def parse_batch(prompts: Sequence[Sequence[int]], out: Any, top_k: int, vocab_size: int) -> list[PromptLogprobs]:
    """SGLang's answer to one generate_request (a list, or one dict for one prompt) -> one PromptLogprobs each."""
    out = out if isinstance(out, list) else [out]
    if len(out) != len(prompts):
        raise ValueError(f"SGLang answered {len(out)} items for {len(prompts)} prompts")
    return [parse_response(p, o, top_k, vocab_size) for p, o in zip(prompts, out)]


def resolve(config: EngineConfig, opts: dict[str, Any], launch: bool = True) -> dict[str, Any]:
    """What the engine needs from lpdiff's side, computed in the caller's process: the vocabulary size and, when
    lpdiff starts SGLang (``launch``), the ServerArgs with the checkpoint written by the caller's transformers (the
    same build as the HF reference's). The lane child then needs neither lpdiff's catalog nor its transformers."""
    from lpdiff.harness.spec.catalog import hf_config

    out: dict[str, Any] = {"vocab_size": hf_config(config.model).get_text_config().vocab_size}
    if launch:
        from lpdiff.engines.checkpoint import checkpoint_dir

        # checkpoint_dir gives back the GPU blocks its build cached: SGLang sizes its pools from free memory
        path = checkpoint_dir(config.model, opts.get("checkpoint_dir"), on_cpu=False)
        out["server_args"] = server_args(config, path, opts.get("server_args"))
    return out


# -- offline: sgl.Engine, run inside the lane's child process ------------------------------------------------------

class SGLangOffline:
    """``sgl.Engine`` as an lpdiff engine. Runs in the lane's child (see SGLangEngine); never in the caller."""

    name = "sglang"

    def __init__(self, config: EngineConfig):
        self.config, self.opts = config, dict(config.options)
        self.engine = None

    def __enter__(self) -> "SGLangOffline":
        try:
            import sglang as sgl
        except ImportError as e:
            raise ImportError(_NOT_INSTALLED.format(python=sys.executable)) from e
        res = self.opts.get(_RESOLVED) or resolve(self.config, self.opts)
        self.vocab = res["vocab_size"]
        self.engine = sgl.Engine(**res["server_args"])
        return self

    def __exit__(self, *exc) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def version(self) -> str:
        import sglang
        import torch

        return f"sglang {sglang.__version__}, torch {torch.__version__}"

    def prompt_logprobs(self, prompts, adapter: AdapterChoice = None, top_k: int = 0) -> list[PromptLogprobs]:
        names = check_request(prompts, adapter, self.config.adapters)
        out = self.engine.generate(**generate_request(prompts, names, top_k, self.vocab))
        return parse_batch(prompts, out, top_k, self.vocab)


# -- HTTP: a launched or running server ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangHTTP:
    """/generate on a running server (``url``), or on one launched here under a ManagedProcess whose log tail is
    attached when it dies."""

    name = "sglang"

    def __init__(self, config: EngineConfig, opts: dict[str, Any], lane: LaneConfig, resolved: dict[str, Any]):
        self.config, self.opts, self.lane, self.resolved = config, opts, lane, resolved
        self.url = opts.get("url")
        self.timeout = opts.get("request_timeout_s")  # None: the lane's work-scaled call deadline
        self.server: ManagedProcess | None = None

    def __enter__(self) -> "SGLangHTTP":
        self.vocab = self.resolved["vocab_size"]
        if self.url is None:
            port = int(self.opts.get("port") or _free_port())
            argv = [self.lane.python, "-m", "sglang.launch_server", *server_cli(self.resolved["server_args"]),
                    "--host", "127.0.0.1", "--port", str(port)]
            self.server = ManagedProcess(argv, self.lane.env, self.lane.log_path, self.lane.tail_lines,
                                         log_prefix="lpdiff-sglang-server-").start()
            self.url = f"http://127.0.0.1:{port}"
            self._wait_ready(self.lane.start_timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.kill()
            self.server = None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            rc = self.server.poll()
            if rc is not None:
                died = self.server.died("starting the SGLang server", rc, f"exited with status {rc}")
                self.__exit__()
                raise died
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                died = self.server.died("starting the SGLang server", None, f"was not ready in {timeout:.0f} s")
                self.__exit__()
                raise died
            time.sleep(1.0)

    def post(self, path: str, payload: dict[str, Any], tokens: int = 0) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            timeout = float(self.timeout) if self.timeout is not None else self.lane.call_timeout(tokens)
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # the server answered: its message says what was wrong
            raise RuntimeError(f"SGLang {path} answered {e.code}: {e.read().decode(errors='replace')[:2000]}") \
                from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            if self.server is not None:
                try:
                    rc = self.server.proc.wait(timeout=5)
                except Exception:  # noqa: BLE001 - still running: the request itself failed
                    rc = None
                if rc is not None:
                    raise self.server.died(f"SGLang {path}", rc, f"exited with status {rc}") from None
            raise RuntimeError(f"SGLang {path} at {self.url} failed: {e}") from None

    def version(self) -> str:
        try:
            with urllib.request.urlopen(self.url + "/model_info", timeout=10) as r:
                info = json.loads(r.read())
            return f"sglang server {self.url} ({info.get('model_path', '?')})"
        except (urllib.error.URLError, ValueError):
            return f"sglang server {self.url}"

    def prompt_logprobs(self, prompts, adapter: AdapterChoice = None, top_k: int = 0) -> list[PromptLogprobs]:
        names = check_request(prompts, adapter, self.config.adapters)
        out = self.post("/generate", generate_request(prompts, names, top_k, self.vocab), sum(map(len, prompts)))
        return parse_batch(prompts, out, top_k, self.vocab)


# -- the engine ----------------------------------------------------------------------------------------------------

class SGLangEngine:
    name = "sglang"

    def __init__(self, config: EngineConfig):
        lane, opts = lane_config_from_options({"lane": "subprocess", **config.options})
        if lane is None:
            raise ValueError("the sglang engine always runs in a subprocess lane (a PEFT 3D adapter kills SGLang's "
                             "process); drop option lane='inprocess'")
        unknown = sorted(set(opts) - set(_OWN_OPTIONS))
        if unknown:
            raise ValueError(f"unknown sglang engine options {unknown}; known: {', '.join(_OWN_OPTIONS)}, python, "
                             "lane_env, lane_start_timeout_s, lane_call_timeout_s, lane_log")
        self.mode = opts.get("mode", "offline")
        if self.mode not in ("offline", "http"):
            raise ValueError(f"option mode must be 'offline' or 'http', got {self.mode!r}")
        if config.dtype == "float32":
            server_args(config, "")  # raises the fp32 error before anything starts
        self.config, self.opts, self.lane = config, opts, lane
        self._impl = None

    def __enter__(self) -> "SGLangEngine":
        resolved = resolve(self.config, self.opts, launch=self.mode == "offline" or "url" not in self.opts)
        if self.mode == "offline":
            child = strip_lane_options(self.config)
            child = replace(child, options={**child.options, _RESOLVED: resolved})
            self._impl = LaneEngine(self.name, "lpdiff.engines.sglang:SGLangOffline", child, self.lane)
        else:
            self._impl = SGLangHTTP(self.config, self.opts, self.lane, resolved)
        self._impl.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._impl is not None:
            self._impl.__exit__(*exc)
            self._impl = None

    def version(self) -> str:
        return self._impl.version() if self._impl is not None else "sglang (not started)"

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None,
                        top_k: int = 0) -> list[PromptLogprobs]:
        if self._impl is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('sglang', cfg) as eng:`")
        return self._impl.prompt_logprobs(prompts, adapter, top_k)
