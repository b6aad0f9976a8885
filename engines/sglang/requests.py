"""What lpdiff asks SGLang for and how it reads the answer: ServerArgs (MOE_LORA_SETTINGS, ARCH_SETTINGS), the
launch_server flags, the /generate request and the parsing of its prompt logprobs. Pure: tested without SGLang."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.capabilities import model_type
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import PromptLogprobs

MOE_LORA_SETTINGS: dict[str, Any] = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
    "moe_runner_backend": "triton",
    "lora_backend": "triton",
    "disable_cuda_graph": True,
    "disable_radix_cache": True,
    "skip_server_warmup": True,
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
    "nemotron_h": {
        "attention_backend": "torch_native",
        "disable_shared_experts_fusion": True,
        "lora_target_modules": ["all"],
    },
    "qwen3_5_moe": {"disable_shared_experts_fusion": True, "enable_multimodal": False},
}


def server_args(config: EngineConfig, model_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """ServerArgs fields (the keyword arguments of ``sgl.Engine``) for this config."""
    from lpdiff.harness.spec.adapters import adapter_max_rank

    if config.dtype == "float32":
        raise InputError(
            "SGLang has no fp32 path (sgl_kernel's rmsnorm takes bf16/fp16): use dtype bfloat16 and "
            "compare against an fp32 reference"
        )
    # log_level: sgl.Engine defaults to "error", which would hide the LoRA loading lines ("loaded weights for
    # target modules", "weight(s) skipped") that the lane's log tail should carry when something goes wrong
    args: dict[str, Any] = {
        "model_path": model_path,
        "skip_tokenizer_init": True,
        "dtype": config.dtype,
        "tp_size": config.tp,
        "random_seed": 0,
        "log_level": "info",
        **MOE_LORA_SETTINGS,
        **ARCH_SETTINGS.get(model_type(config.model.arch), {}),
    }
    if config.options.get("capture_routing"):  # meta_info["routed_experts"] on requests that ask for it
        args["enable_return_routed_experts"] = True
    if config.adapters:
        args.update(
            enable_lora=True,
            lora_paths={n: str(a.path) for n, a in config.adapters.items()},
            max_lora_rank=max(adapter_max_rank(a.path) for a in config.adapters.values()),
            max_loras_per_batch=len(config.adapters) + 1,
        )  # + the base model's slot
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


def generate_request(
    prompts: Sequence[Sequence[int]], names: Sequence[str | None], top_k: int, vocab_size: int, routing: bool = False
) -> dict[str, Any]:
    """One batched /generate request (also the keyword arguments of ``Engine.generate``); ``routing``: ask for
    each token's expert ids (``return_routed_experts``; the server needs enable_return_routed_experts)."""
    req: dict[str, Any] = {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    k = sglang_top_k(top_k, vocab_size)
    if k:
        req["top_logprobs_num"] = k
    if any(n is not None for n in names):
        req["lora_path"] = list(names)
    if routing:
        req["return_routed_experts"] = True
    return req


def parse_routed_experts(num_tokens: int, meta: dict[str, Any], shape: dict[str, Any]) -> np.ndarray:
    """``meta_info["routed_experts"]`` -> (num_tokens, L, K) int32 expert ids per prompt token and MoE layer.

    SGLang (``--enable-return-routed-experts`` + ``return_routed_experts``) sends the int32 array
    [tokens, layers, top_k] as base64 (its R3 docs: b64decode -> np.frombuffer(int32) -> reshape(-1, layers,
    top_k)); its layer axis is the text config's num_hidden_layers. ``shape``: {"layers": that count, "top_k",
    "moe_layers": the layers that route, or None for all}. Rows it does not give (at most the last prompt token,
    which no logprob position sees) are -1."""
    import base64

    raw = meta.get("routed_experts") if meta else None
    if raw is None:
        raise ValueError(
            "SGLang returned no meta_info.routed_experts: the server needs "
            "enable_return_routed_experts and the request return_routed_experts (option capture_routing)"
        )
    flat = (
        np.frombuffer(base64.b64decode(raw), dtype=np.int32)
        if isinstance(raw, (str, bytes))
        else np.asarray(raw, dtype=np.int32).reshape(-1)
    )
    layers, k = int(shape["layers"]), int(shape["top_k"])
    if flat.size % (layers * k) or flat.size // (layers * k) < num_tokens - 1:
        raise ValueError(
            f"SGLang's routed_experts holds {flat.size} ids: not [at least {num_tokens - 1} tokens, "
            f"{layers} layers, {k}]"
        )
    arr = flat.reshape(-1, layers, k)
    if shape.get("moe_layers") is not None:
        arr = arr[:, list(shape["moe_layers"])]
    out = np.full((num_tokens, arr.shape[1], k), -1, dtype=np.int32)
    rows = min(num_tokens, arr.shape[0])
    out[:rows] = arr[:rows]
    return out


def parse_response(
    token_ids: Sequence[int], item: dict[str, Any], top_k: int = 0, vocab_size: int | None = None
) -> PromptLogprobs:
    """One element of SGLang's answer -> PromptLogprobs (``top_k`` as given to generate_request: 0, k or -1).
    ``vocab_size``: the model's; SGLang reports token ids >= vocab_size - 1 as 0, which is then not a mismatch."""
    n = len(token_ids)
    meta = item.get("meta_info") if isinstance(item, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if meta is None or entries is None:
        raise ValueError(
            "SGLang returned no meta_info.input_token_logprobs: the request needs return_logprob=True "
            "and logprob_start_len=0"
        )
    if len(entries) != n:
        raise ValueError(
            f"SGLang returned {len(entries)} input logprobs for a prompt of {n} tokens (logprob_start_len must be 0)"
        )
    want_ids = [int(t) for t in token_ids]
    if vocab_size is not None:  # logprob_result_processor.py:53 clips these ids to 0
        want_ids = [0 if t >= vocab_size - 1 else t for t in want_ids]
    got_ids = [int(e[1]) for e in entries]
    if got_ids != want_ids:
        bad = next(i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b)
        raise ValueError(
            f"SGLang's logprobs are for other tokens (position {bad}: {got_ids[bad]} != "
            f"{token_ids[bad]}); run it with skip_tokenizer_init=True and token-id prompts"
        )
    if any(e[0] is None for e in entries[1:]):
        raise ValueError("SGLang returned None logprobs past the first position")
    lp = np.asarray([e[0] for e in entries[1:]], dtype=np.float32)
    tk_ids = tk_lp = None
    if top_k:
        tops = meta.get("input_top_logprobs")
        if tops is None or len(tops) != n:
            raise ValueError(
                "SGLang returned no input_top_logprobs for every position: the request needs top_logprobs_num"
            )
        ids_rows, lp_rows = [], []
        for i, row in enumerate(tops[1:], start=1):
            row = sorted(row or [], key=lambda e: -e[0])
            k = len(row) if top_k == -1 else top_k
            if len(row) < k:
                raise ValueError(f"asked for top {k} logprobs, SGLang returned {len(row)} at position {i}")
            ids_rows.append([int(e[1]) for e in row[:k]])
            lp_rows.append([e[0] for e in row[:k]])
        tk_ids, tk_lp = np.asarray(ids_rows, dtype=np.int64), np.asarray(lp_rows, dtype=np.float32)
    return PromptLogprobs(
        token_ids=np.asarray(token_ids, dtype=np.int64), logprobs=lp, topk_ids=tk_ids, topk_logprobs=tk_lp
    )


def parse_batch(
    prompts: Sequence[Sequence[int]], out: Any, top_k: int, vocab_size: int, routing: dict[str, Any] | None = None
) -> list[PromptLogprobs]:
    """SGLang's answer to one generate_request (a list, or one dict for one prompt) -> one PromptLogprobs each;
    ``routing``: parse_routed_experts' shape, when the request asked for expert ids."""
    out = out if isinstance(out, list) else [out]
    if len(out) != len(prompts):
        raise ValueError(f"SGLang answered {len(out)} items for {len(prompts)} prompts")
    res = [parse_response(p, o, top_k, vocab_size) for p, o in zip(prompts, out)]
    if routing is not None:
        res = [
            replace(r, routed_experts=parse_routed_experts(len(p), o.get("meta_info"), routing))
            for r, p, o in zip(res, prompts, out)
        ]
    return res


def decode_request(
    prompts: Sequence[Sequence[int]], names: Sequence[str | None], max_new_tokens: int, sampling: str, seed: int
) -> dict[str, Any]:
    """One batched generate request for decoding: exactly ``max_new_tokens`` per prompt (EOS ignored), the
    sampled tokens' logprobs in meta_info["output_token_logprobs"]. Greedy is temperature 0, which SGLang's
    SamplingParams turns into temperature 1 with top_k 1 (srt/sampling/sampling_params.py), so the logprobs are of
    the raw distribution either way; seeded is temperature 1 with no top-p / top-k and ``sampling_seed`` seed + i per
    prompt (a field of those SamplingParams, read in SGLang's source; whether 0.5.15 honours it outside its
    deterministic-inference mode is not measured: the seeded lane's tokens would then differ between runs, while
    the verdict, a prefill of whatever was generated, stays valid)."""

    def params(i: int) -> dict[str, Any]:
        p = {
            # ignore_eos alone makes it exactly max_new_tokens: SGLang 0.5.15 refuses min_new_tokens when the
            # tokenizer is not loaded (skip_tokenizer_init, as lpdiff runs it: ValueError "min_new_tokens=16 is
            # unavailable when skip_tokenizer_init=True", sampling/sampling_params.py, seen on an H200)
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
            "temperature": 0.0 if sampling == "greedy" else 1.0,
            "top_p": 1.0,
            "top_k": -1,
        }
        if sampling != "greedy":
            p["sampling_seed"] = seed + i
        return p

    req: dict[str, Any] = {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": [params(i) for i in range(len(prompts))],
        "return_logprob": True,
    }
    if any(n is not None for n in names):
        req["lora_path"] = list(names)
    return req


def parse_decode(prompts: Sequence[Sequence[int]], out, max_new_tokens: int) -> list:
    """SGLang's answer to decode_request -> engines.base.Generated per prompt. ``output_token_logprobs`` holds
    (logprob, token id, text) per generated token."""
    from lpdiff.engines.base import Generated

    items = out if isinstance(out, list) else [out]
    if len(items) != len(prompts):
        raise ValueError(f"SGLang answered {len(items)} items for {len(prompts)} prompts")
    res = []
    for p, item in zip(prompts, items):
        entries = (item.get("meta_info") or {}).get("output_token_logprobs") if isinstance(item, dict) else None
        if entries is None:
            raise ValueError("SGLang returned no meta_info.output_token_logprobs: the request needs return_logprob")
        if len(entries) != max_new_tokens:
            raise ValueError(f"SGLang generated {len(entries)} tokens, {max_new_tokens} were asked for")
        res.append(
            Generated(
                [int(t) for t in p], [int(e[1]) for e in entries], np.asarray([e[0] for e in entries], dtype=np.float32)
            )
        )
    return res
