"""The doctor stage's detectors: for each engine defect id the doctor can test (lpdiff.engines.capabilities declares
the defects), a function of the facts (doctor_facts.Facts) and the engine's capabilities that returns the fields of
the defect's message, or None when this adapter on this model does not have it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lpdiff.engines import Capabilities
from lpdiff.harness.pipeline.doctor_facts import Facts
from lpdiff.harness.spec.adapters.inspection import several

_ROUTER_LEAVES = ("gate", "router")
_PER_EXPERT_KEY = re.compile(r".+\.experts\.\d+\.\w+")


def _matches(target: str, names) -> list[str]:
    return [n for n in names if n == target or n.endswith("." + target)]


# -- detectors: defect id -> (facts, the engine's capabilities) -> the message's fields, or None -------------------

Detector = Callable[[Facts, Capabilities], "dict[str, Any] | None"]


def _always(f: Facts, caps: Capabilities) -> dict[str, Any]:
    return {}


def _router_hits(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    """LoRA on the MoE router: named by the adapter's tensors or targets, or converted by PEFT to a parameter."""
    tm = f.config.get("target_modules")
    named = set(tm) if isinstance(tm, (list, tuple)) else set()
    hit = sorted(
        {r for r in f.routers if r in f.key_modules or any(_matches(t, [r]) for t in named)}
        | {r for r in f.routers if r + ".weight" in f.peft_params}
    )
    if not hit:
        return None
    return {
        "where": several(hit),
        "router_fix": "drop the router from target_modules; adapt the experts instead (target_parameters)",
    }


def _peft_mamba(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    if f.peft_error is None or not re.search(r"incompatible with Mamba", f.peft_error):
        return None
    return {"error": f.peft_error[:160]}


def _peft_refused(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    """What PEFT (the reference) refuses, found by injecting the adapter's LoraConfig into the meta model; a target
    that matches nothing is check_targets_match's, for every engine."""
    if (
        f.peft_error is None
        or re.search(r"incompatible with Mamba", f.peft_error)
        or "not found in the base model" in f.peft_error
    ):
        return None
    router = " (the router is not a Linear PEFT can wrap)" if re.search(r"Router|Gate\(", f.peft_error) else ""
    return {"router": router, "error": f.peft_error[:200]}


def _wrapped_without_weights(random_init: bool) -> Detector:
    """PEFT wraps every module its target names match; one with no tensors in the file keeps PEFT's init: B = 0 by
    default, random A and B with init_lora_weights=false. Per-expert adapters hit this: their gate/up/down_proj
    names also match shared experts, but the hf engine hands PEFT their PEFT 3D conversion, whose target_modules name
    only modules with tensors: a per-expert file is not checked (its raw-PEFT finding says to convert it)."""

    def detect(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
        if f.info.layout == "per_expert":
            return None
        missing = sorted(m for m in f.peft_modules if m not in f.key_modules)
        if not missing or (f.config.get("init_lora_weights", True) is False) != random_init:
            return None
        return {"where": several(missing)}

    return detect


def _per_expert_unknown(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    known = [d for d in caps.defects(f.arch, "per_expert") if d.archs and "per_expert" in d.layouts]
    return None if known else {}


def _qkv(f: Facts) -> set[str]:
    return f.target_leaves & {"q_proj", "k_proj", "v_proj"}


def _q_without_v(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    qkv = _qkv(f)
    return {} if "q_proj" in qkv and "v_proj" not in qkv else None


def _kv_without_q(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    qkv = _qkv(f)
    return {"qkv": " and ".join(sorted(qkv))} if qkv and "q_proj" not in qkv else None


def _experts_half_targeted(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    if not any("gate_proj" in parts for parts in f.expert_modules.values()):
        return None
    parts = {k.rsplit(".", 1)[-1] for k in f.key_modules if _PER_EXPERT_KEY.fullmatch(k)}
    if not parts or (parts & {"gate_proj", "up_proj"} and "down_proj" in parts):
        return None
    return {
        "parts": ", ".join(sorted(parts)),
        "missing": "down_proj" if "down_proj" not in parts else "gate_proj/up_proj",
    }


def _gate_up_a_differ(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    from safetensors import safe_open

    from lpdiff.harness.spec.adapters import WEIGHTS_NAME

    differ = 0
    with safe_open(str(Path(f.info.path) / WEIGHTS_NAME), framework="pt") as fh:
        for k in (k for k in f.info.keys if ".gate_proj.lora_A." in k):
            up = k.replace(".gate_proj.", ".up_proj.")
            if up in f.info.keys and not fh.get_tensor(k).equal(fh.get_tensor(up)):
                differ += 1
    return {"differ": differ} if differ else None


def _target_pattern(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    tm = f.config.get("target_modules")
    return {"pattern": repr(tm)} if isinstance(tm, str) and tm not in ("all", "all-linear") else None


def _unsupported_targets(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    tm = f.config.get("target_modules")
    targets = caps.lora_targets_for(f.arch)
    if targets is None or (isinstance(tm, str) and tm not in ("all", "all-linear")):
        return None  # a pattern string is sglang-target-modules-string's
    leaves = {x for x in f.target_leaves - set(_ROUTER_LEAVES) - {"experts", "base_layer"} if not x.isdigit()}
    bad = sorted(leaves - targets)
    return {"bad": ", ".join(bad), "supported": ", ".join(sorted(targets))} if bad else None


def _tensors_on(leaf: str, experts: bool | None = None) -> Detector:
    """The adapter has LoRA tensors for modules with this leaf name: per-expert ones (experts.N.leaf) only, all
    others only, or both (None)."""
    pattern = re.compile(rf"(?:base_model\.model\.)?(.+\.{leaf})\.lora_[AB]\.weight")

    def detect(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
        hit = sorted(
            {
                m.group(1)
                for k in f.info.keys
                if (m := pattern.fullmatch(k)) and experts in (None, bool(_PER_EXPERT_KEY.fullmatch(m.group(1))))
            }
        )
        return {"where": several(hit)} if hit else None

    return detect


def _set_features(c: dict[str, Any]) -> list[str]:
    """adapter_config.json features that are on, by the names Capabilities uses."""
    on = [k for k in ("use_dora", "lora_bias") if c.get(k)]
    if c.get("bias", "none") != "none":
        on.append("bias")
    if c.get("modules_to_save"):
        on.append("modules_to_save")
    init = c.get("init_lora_weights")
    if isinstance(init, str) and init.lower().split("_")[0] in ("pissa", "olora", "loftq", "corda"):
        on.append(f"init_lora_weights={init}")
    return on + [k for k in ("rank_pattern", "alpha_pattern", "use_rslora") if c.get(k)]


def _features(field_name: str) -> Detector:
    def detect(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
        hit = [x for x in _set_features(f.config) if x.split("=")[0] in getattr(caps, field_name)]
        return {"features": ", ".join(hit)} if hit else None

    return detect


def _moe_rank(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    limit, r = caps.max_moe_rank, f.max_rank
    if limit is None or r <= limit or "experts" not in f.info.groups or (caps.max_rank and r > caps.max_rank):
        return None  # above max_rank: check_ranks says rank-above-max
    return {"rank": r, "limit": limit}


def _outside_root(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    """Tensors not under the decoder root the engine maps adapter names from (vLLM on Qwen3.5's wrapper
    checkpoint): it places none of them. The fix writes them under that root, in a layout the engine reads."""
    from lpdiff.harness.spec.adapters import reroot_fix

    root = caps.adapter_root(f.arch)
    return reroot_fix(f.info, f.model_ref, root, caps.layouts_for(f.arch)) if root else None


def _moe_lora(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    return {} if f.num_experts and f.key_modules else None


def _rslora(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    return {} if f.info.rslora else None


def _vocab_lora(f: Facts, caps: Capabilities) -> dict[str, Any] | None:
    """Tensors for lm_head or the input embedding (Linear or Embedding LoRA)."""
    from lpdiff.harness.spec.adapters import VOCAB_GROUPS, module_group

    hit = sorted(m for m in f.info.modules() if module_group(m) in VOCAB_GROUPS)
    return {"where": several(hit)} if hit else None


DETECTORS: dict[str, Detector] = {
    "peft-mamba-refused": _peft_mamba,
    "peft-refused": _peft_refused,
    "peft-random-init-modules": _wrapped_without_weights(True),
    "peft-empty-modules": _wrapped_without_weights(False),
    "router-target": _router_hits,
    "per-expert-ignored-by-peft": _always,
    "per-expert-converted-by-peft": _always,
    "per-expert-unknown": _per_expert_unknown,
    "vllm-per-expert-interleaved": _always,
    "vllm-qwen3.5-per-expert": _always,
    "vllm-qwen3.5-text-names": _outside_root,
    "peft3d-needs-mixed-format": _always,
    "vllm-peft3d-mixed-format-faults": _always,
    "peft3d-kills-sglang": _always,
    "q-without-v": _q_without_v,
    "kv-without-q": _kv_without_q,
    "sglang-experts-half-targeted": _experts_half_targeted,
    "sglang-gpt-oss-gate-up-a": _gate_up_a_differ,
    "sglang-target-modules-string": _target_pattern,
    "sglang-unsupported-target": _unsupported_targets,
    "moe-rank-above-128": _moe_rank,
    "vllm-unsupported-feature": _features("refused_features"),
    "sglang-ignores-scaling": _features("ignored_features"),
    "vllm-moe-lora-gpu": _moe_lora,
    "sglang-gpt-oss-runner": _always,
    "vllm-nemotron-peft3d": _always,
    "sglang-nemotron-up-proj": _tensors_on("up_proj", experts=True),
    "sglang-nemotron-shared-up-proj": _tensors_on("up_proj", experts=False),
    "sglang-mamba-in-proj": _tensors_on("in_proj"),
    "vllm-ignores-patterns": _features("ignored_features"),
    "vllm-per-expert-rslora": _rslora,
    "vllm-qwen3.5-vocab-lora": _vocab_lora,
    "vllm-lm-head-prompt-logprobs": _tensors_on("lm_head"),
    "vllm-nemotron-step-fault": _moe_lora,
    "vllm-nemotron-latent-dropped": _tensors_on("fc[12]_latent_proj"),
}
