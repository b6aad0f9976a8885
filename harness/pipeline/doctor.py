"""The doctor stage: before any engine runs, what each engine will refuse or silently ignore in this adapter on this
model, one finding each with the fix. ``refusals`` is what stops a run (preflight, check, the metamorphic
relations); ``lpdiff doctor`` (commands/doctor.py) prints every finding.

Facts come from three places. The model's structure: the model is built on the meta device (no weights, so
full-size configs are fine) and its module and parameter names are read. The adapter: ``inspect_adapter`` (config
and tensor keys, no model). The engines: each declares its limits and known defects (``lpdiff.engines.capabilities``,
read through ``lpdiff.engines.capabilities(name)``), and the doctor tests each defect it has a detector for; for
HF+PEFT it also asks PEFT itself, injecting the adapter's LoraConfig into the meta model (that is where PEFT refuses
routers it cannot wrap and Nemotron's Mamba out_proj/conv1d).
"""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from lpdiff.engines import ENGINES as ALL_ENGINES
from lpdiff.engines import Capabilities, capabilities
from lpdiff.harness.pipeline.doctor_inputs import check_noop, resolve_adapter
from lpdiff.harness.spec.adapters.inspection import several
from lpdiff.harness.spec.errors import InputError

# the engines whose adapter handling the doctor knows (Capabilities.adapter_doctor; triton reads every layout)
ENGINES = tuple(e for e in ALL_ENGINES if capabilities(e).adapter_doctor)
RANK_LIMITED = tuple(e for e in ENGINES if capabilities(e).max_lora_rank_option)  # doctor --max-lora-rank
SEVERITIES = ("error", "warning", "info")
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
        return {
            "model": self.model,
            "arch": self.arch,
            "adapter": self.adapter,
            "layout": self.layout,
            "rank": self.rank,
            "engines": self.engines,
            "exit_code": self.exit_code,
            "findings": [asdict(f) for f in self.findings],
        }


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
    problems: list = field(default_factory=list)  # the validation layer's Problems: what a run refuses (or warns)

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
    """A ModelSpec as given; a catalog name, checkpoint directory or Hub id[@rev] through the one resolver (config
    and tokenizer only: doctor never needs the weights)."""
    from lpdiff.harness.types import ModelSpec

    if isinstance(model, ModelSpec):
        return model
    from lpdiff.harness.spec.resolve import resolve_model

    return resolve_model(str(model), weights=False)


# PEFT's injection depends only on the model's config and the adapter's adapter_config.json, not on its tensors:
# the metamorphic suite asks the doctor about a dozen transformed copies of one adapter (same config, or only
# r/alpha changed), so it is kept per config (bounded: a handful of models per process); the model's facts are
# the validation layer's (built once per config there). The cached values are only read.
_CACHE_SIZE = 16
_PEFT_CACHE: dict[tuple[str, str], tuple] = {}  # (model config JSON, adapter_config.json text) -> _peft_inject


def _remember(cache: dict, key, make: Callable[[], Any]) -> Any:
    if key not in cache:
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return cache[key]


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
    """Unreadable adapter files (no directory, broken JSON, pickle weights) raise the validation layer's one-line
    ValidationError (exit 2); what the files hold is checked by its ``adapter_problems``."""
    from lpdiff.harness.spec.adapters import inspect_adapter
    from lpdiff.harness.spec.validate import adapter_problems, model_facts, read_adapter_config

    spec = _resolve_model(model)
    adapter_dir = str(adapter_dir)
    config = read_adapter_config(adapter_dir)
    config_text = (Path(adapter_dir) / "adapter_config.json").read_text()
    mf = model_facts(spec)
    problems = adapter_problems(adapter_dir, mf, spec.num_layers)
    info = inspect_adapter(adapter_dir)
    model_key, meta, layout, modules, params = mf.key, mf.meta, mf.layout, mf.modules, mf.params
    experts = {p.module: p for p in layout.experts.values()}
    expert_modules = {
        m: tuple(part for q in layout.experts.values() if q.module == m for part in q.parts) for m in experts
    }
    routers = set(mf.routers)
    key_modules, foreign = set(), []
    for k in info.keys:
        try:
            key_modules.add(layout.memory_path(k)[0])
        except ValueError:
            foreign.append(k)
    num_experts = max((p.num_experts for p in layout.experts.values()), default=0)
    peft_error, peft_modules, peft_params = _remember(
        _PEFT_CACHE, (model_key, config_text), lambda: _peft_inject(copy.deepcopy(meta), adapter_dir)
    )
    facts = Facts(
        arch=layout.model_type,
        num_experts=num_experts,
        modules=dict(modules),
        params=set(params),
        routers=routers,
        expert_modules=expert_modules,
        info=info,
        config=config,
        key_modules=key_modules,
        foreign_keys=foreign,
        peft_error=peft_error,
        peft_modules=set(peft_modules),
        peft_params=set(peft_params),
        limits=dict(limits or {}),
        model_ref=str(model) if isinstance(model, (str, Path)) else spec.name,
        problems=problems,
    )
    return spec, facts


# -- checks --------------------------------------------------------------------------------------------------------
# Checks for every engine ("all": the adapter does not fit the model), then each engine's declared defects
# (lpdiff.engines.capabilities), each tested by the detector of its id below.


def _convert_cmd(facts: Facts, to: str) -> str:
    from lpdiff.harness.spec.adapters import convert_command

    return convert_command(facts.model_ref, facts.info.path, to)


def _matches(target: str, names) -> list[str]:
    return [n for n in names if n == target or n.endswith("." + target)]


def check_adapter_files(f: Facts) -> list[Finding]:
    """What the validation layer finds for every engine (a run refuses the errors: exit 2): another architecture,
    no tensors, NaN/Inf, shapes or ranks that do not fit, targets naming nothing or without tensors; plus tensors
    that are not plain LoRA A/B weights (vLLM and SGLang refuse them)."""
    out = [Finding("all", p.severity, p.code, p.what, p.fix) for p in f.problems]
    if f.foreign_keys:
        out.append(
            Finding(
                "all",
                "error",
                "not-plain-lora",
                f"{len(f.foreign_keys)} tensor(s) are not LoRA A/B weights (e.g. {f.foreign_keys[0]}): "
                "DoRA magnitudes, biases or modules_to_save, which vLLM and SGLang refuse",
                "save a plain LoRA adapter (no use_dora, lora_bias or modules_to_save)",
            )
        )
    return out


def check_expert_count(f: Facts) -> list[Finding]:
    """An expert adapter for another expert count misreads every expert slice."""
    n = f.info.num_experts
    if n is None or not f.num_experts or n == f.num_experts:
        return []
    return [
        Finding(
            "all",
            "error",
            "expert-count",
            f"the adapter has {n} experts' weights, the model {f.num_experts} experts",
            "generate the adapter for this model",
        )
    ]


def check_ranks(f: Facts, engines: Sequence[str]) -> list[Finding]:
    """Ranks above what an engine can hold: its largest max_lora_rank, or the max the user runs it with."""
    out, r = [], f.max_rank
    for engine in engines:
        caps = capabilities(engine)
        if caps.max_rank is not None and r > caps.max_rank:
            out.append(
                Finding(
                    engine,
                    "error",
                    "rank-above-max",
                    f"adapter rank {r} exceeds {caps.label}'s largest max_lora_rank {caps.max_rank}",
                    f"re-train or truncate the adapter to rank <= {caps.max_rank}",
                )
            )
    for engine, limit in f.limits.items():
        if r > limit:
            out.append(
                Finding(
                    engine,
                    "error",
                    "rank-above-max",
                    f"adapter rank {r} exceeds {engine}'s max_lora_rank {limit}: the adapter is refused",
                    f"start {engine} with max_lora_rank >= {r} (lpdiff's engines size it from the adapters by default)",
                )
            )
    return out


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
    "vllm-nemotron-step-fault": _moe_lora,
    "vllm-nemotron-latent-dropped": _tensors_on("fc[12]_latent_proj"),
}


def check_engine_defects(f: Facts, engine: str) -> list[Finding]:
    """The engine's declared defects for this arch and layout whose detector finds them in this adapter. A defect
    that depends on what the files cannot show (the TP size, the batch) has no detector and is not reported."""
    caps, out = capabilities(engine), []
    common = {
        "arch": f.arch,
        **{f"to_{lay}": _convert_cmd(f, lay) for lay in ("peft3d", "per_expert", "per_expert_gate")},
    }
    for d in caps.defects(f.arch, f.info.layout):
        if d.tp or d.id not in DETECTORS or (fields := DETECTORS[d.id](f, caps)) is None:
            continue
        what, fix = d.message(**common, **fields)
        out.append(Finding(engine, d.severity, d.id, what, fix))
    return out


# -- entry points ---------------------------------------------------------------------------------------------------


def doctor(
    model, adapter_dir: str | Path, engines: Sequence[str] | None = None, limits: dict[str, int] | None = None
) -> "DoctorReport":
    """model: a ModelSpec, a catalog name, a checkpoint directory or a Hub id; adapter_dir: a PEFT directory, a zoo
    adapter name or a Hub repo (resolve_adapter); engines: a subset of ENGINES (default all); limits: engine -> the
    max_lora_rank it will be started with."""
    engines = list(engines or ENGINES)
    for e in engines:
        if e not in ENGINES:
            raise InputError(f"doctor knows engines {', '.join(ENGINES)}, not {e!r}")
    adapter_dir = resolve_adapter(model, adapter_dir)
    spec, facts = gather(model, adapter_dir, limits)
    findings = [
        *check_adapter_files(facts),
        *check_noop(facts),
        *check_expert_count(facts),
        *check_ranks(facts, engines),
        *(x for e in engines for x in check_engine_defects(facts, e)),
    ]
    findings = [x for x in findings if x.engine in (*engines, "all")]
    rank = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda x: (rank[x.severity], x.engine))
    return DoctorReport(
        model=spec.name,
        arch=facts.arch,
        adapter=str(adapter_dir),
        layout=facts.info.layout,
        rank=facts.max_rank,
        engines=engines,
        findings=findings,
    )


class Refusals(NamedTuple):
    errors: list[Finding]  # the engine refuses the adapter, dies on it, or computes something else with it
    warnings: list[Finding]  # it may


def refusals(spec, adapter_dir: str | Path, engine: str) -> Refusals:
    """The doctor's findings that hold for ``engine`` on this adapter: its own, and those of every engine ("all":
    the adapter does not fit the model). For an engine whose adapter handling the doctor does not know (triton
    reads every layout), the "all" findings alone. The one place that decides what stops a run: preflight, check
    and the metamorphic relations read it."""
    findings = doctor(spec, adapter_dir, [engine] if engine in ENGINES else [ENGINES[0]]).findings
    mine = [f for f in findings if f.engine in (engine, "all")]
    return Refusals([f for f in mine if f.severity == "error"], [f for f in mine if f.severity == "warning"])
