"""The model catalog: the embedded tiny zoo (checkpoint directories in ``harness/zoo/``) and full-size shapes built
from their real configs with a seeded init (weights cannot be downloaded, so GPU suites build them on the device).

Everything downstream reads MoE structure through ``moe_fields(config)`` instead of raw config fields: the same fact
is spelled ``num_experts`` / ``num_local_experts`` / ``n_routed_experts`` depending on the architecture.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lpdiff.harness.spec.errors import InputError, SpecError, UnknownName
from lpdiff.harness.spec.init_recipe import PEAKED, apply_peaked
from lpdiff.harness.types import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ZOO_DIR = Path(__file__).resolve().parents[1] / "zoo"

# How a config-built model gets its weights. Bump the version whenever any step changes: it is part of every
# baseline key, so old baselines stop matching instead of silently comparing different weights.
#   v1: torch.manual_seed(init_seed); with torch.device(device): cls._from_config(cfg, dtype=bfloat16) (transformers'
#   own _init_weights); then cast to the requested dtype. Init always happens in bf16 so that a bf16 run and an
#   fp32 run hold exactly the same (bf16-representable) weights, as they would from a real bf16 checkpoint.
#   The random stream is the device's: a model built on cuda differs from one built on cpu.
#   peaked/v1 (spec/init_recipe.py): the v1 model, then conditioned on the same device so that routers are decisive
#   and next-token distributions peaked, as a trained model's are.
INIT_RECIPE = "hf-init-bf16/v1"
INIT_RECIPES = (INIT_RECIPE, PEAKED)
# The one place the environment picks a config-built model's recipe (the GPU check runs with e.g.
# LPDIFF_INIT_RECIPE=peaked/v1); unset, the default keeps committed baselines' keys.
INIT_RECIPE_ENV = "LPDIFF_INIT_RECIPE"
INIT_DTYPE = torch.bfloat16
DEFAULT_SEED = 0

# Tiny zoo: name -> transformers model_type (the directory holds config.json, model.safetensors, tokenizer).
ZOO: dict[str, str] = {
    "tiny-qwen3-moe": "qwen3_moe",
    "tiny-gpt-oss": "gpt_oss",
    "tiny-qwen3.5-moe": "qwen3_5_moe_text",
    "tiny-nemotron-h": "nemotron_h",
    "tiny-qwen3-dense": "qwen3",
}


HUB_DIR = Path(__file__).resolve().parent / "hub_configs"

# Full-size models: catalog name -> the Hub repo whose config.json ``hub_configs/<name>.json`` is, and where its
# text was read (the repos' weights and files cannot be downloaded here; these are stored public copies):
#   qwen3-30b-a3b: Qwen/Qwen3-30B-A3B, verbatim (a copy of the repo's config.json quoted in a public test; the
#     MLX conversion of the same repo quotes the same fields plus its quantization).
#   gpt-oss-20b: openai/gpt-oss-20b, verbatim except ``quantization_config`` (MXFP4) is dropped: lpdiff builds bf16
#     weights, the layout of the bf16 copy SGLang tests with (lmsys/gpt-oss-20b-bf16); an MXFP4 entry would make
#     engines look for *_blocks / *_scales tensors that a bf16 checkpoint does not have.
#   qwen3.5-35b-a3b: Qwen/Qwen3.5-35B-A3B, the ConditionalGeneration wrapper (model_type qwen3_5_moe, text_config,
#     vision_config) with the vision config kept and vision weights written: SGLang and vLLM register Qwen3.5 only
#     as Qwen3_5MoeForConditionalGeneration, which builds the vision tower, and vLLM refuses a checkpoint that
#     leaves built parameters unloaded. text_config is the repo's as copied by mlc-ai/pith-train
#     (examples/pretrain_lm/qwen3.5-35b-a3b/config.json); the wrapper, vision_config and the fields pith-train
#     left out (output_router_logits, pad_token_id, partial_rotary_factor) from a verbatim copy of the same-shape
#     Qwen3.6-35B-A3B config quoted in a public test. MTP weights (mtp.*) are not written: engines skip them
#     unless they run speculative decoding.
#   nemotron-3-nano-30b-a3b: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16; fields from a verbatim copy of the
#     NVFP4 release's config.json (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4 @ 6efb4a2a, whose quantization
#     lives in hf_quant_config.json) quoted in a public test. ``auto_map`` (remote code) is dropped: the
#     configuration_/modeling_nemotron_h.py files it names are not in a catalog checkpoint, and a loader run with
#     trust_remote_code would look for them; every engine we pin has nemotron_h built in.
#   nemotron-3-super-120b-a12b: nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 (latent MoE); fields from a copy of
#     the NVFP4 release's config.json (@ 4f0cf9da) quoted in a public test, ``quantization_config`` (NVFP4/FP8)
#     and ``auto_map`` dropped as above. Its shape (512 experts, top-22, hidden 4096, 88 layers: 40 mamba, 40 MoE,
#     8 attention, routed_scaling 5.0, moe_latent_size 1024) agrees with SGLang's sibling test model and
#     Megatron-Bridge's nemotron_h tests.
HUB_REPOS: dict[str, str] = {
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B",
    "nemotron-3-nano-30b-a3b": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "nemotron-3-super-120b-a12b": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
}

# name -> config.json as the Hub ships it (with the deviations above). transformers accepts these spellings on
# load and keeps its own in memory (num_experts, layers_block_type, rope_parameters); the checkpoint writer
# (spec/checkpoint.py) writes these dicts, not transformers' re-serialisation, so older transformers (SGLang's
# 5.12.1) and the engines read what they read from the real repo.
FULL_CONFIGS: dict[str, dict[str, Any]] = {n: json.loads((HUB_DIR / f"{n}.json").read_text()) for n in HUB_REPOS}


def text_arch(cfg: dict[str, Any]) -> str:
    """The model_type of the causal LM lpdiff runs: the text model's for a multimodal wrapper."""
    return (cfg.get("text_config") or cfg)["model_type"]


# -- specs ---------------------------------------------------------------------------------------------------------


def known_models() -> list[str]:
    return list(ZOO) + list(FULL_CONFIGS)


def resolve_init_recipe(name: str | None = None, default: str = INIT_RECIPE) -> str:
    """The init recipe a config-built model gets: ``name``, else $LPDIFF_INIT_RECIPE, else ``default`` (the GPU grid
    passes peaked/v1)."""
    chosen = name or os.environ.get(INIT_RECIPE_ENV) or default
    if chosen not in INIT_RECIPES:
        where = "init_recipe" if name else f"${INIT_RECIPE_ENV}"
        raise SpecError(f"{where}={chosen!r} is not an init recipe; use one of {', '.join(INIT_RECIPES)}")
    return chosen


def get_model(
    name: str, num_layers: int | None = None, init_seed: int = DEFAULT_SEED, init_recipe: str | None = None
) -> ModelSpec:
    """A catalog model by name; ``num_layers`` keeps the first n layers (zoo or full-size); ``init_recipe``
    (full-size only): see ``resolve_init_recipe``."""
    assert num_layers is None or num_layers >= 1, f"num_layers must be >= 1, got {num_layers}"
    if name in ZOO:
        return ModelSpec(name=name, arch=ZOO[name], path=str(ZOO_DIR / name), num_layers=num_layers)
    if name in FULL_CONFIGS:
        cfg = FULL_CONFIGS[name]
        return ModelSpec(
            name=name,
            arch=text_arch(cfg),
            config=json.loads(json.dumps(cfg)),
            init_seed=init_seed,
            init_recipe=resolve_init_recipe(init_recipe),
            num_layers=num_layers,
        )
    raise UnknownName(f"unknown model {name!r}; known models: {', '.join(known_models())}")


def list_models() -> list[ModelSpec]:
    return [get_model(n) for n in known_models()]


# -- configs -------------------------------------------------------------------------------------------------------


def _per_layer_fields(cfg) -> list[str]:
    """Config fields that hold one entry per layer (they must shrink with the depth)."""
    n = cfg.num_hidden_layers
    return [
        k
        for k in ("layer_types", "layers_block_type")
        if isinstance(getattr(cfg, k, None), list) and len(getattr(cfg, k)) == n
    ]


def with_num_layers(cfg, num_layers: int):
    """A copy of ``cfg`` keeping the first ``num_layers`` layers (per-layer lists are truncated the same way)."""
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    n = cfg.num_hidden_layers
    if num_layers > n:
        raise InputError(f"num_layers={num_layers} but the model has only {n} layers; pass num_layers <= {n}")
    for k in _per_layer_fields(cfg):
        setattr(cfg, k, list(getattr(cfg, k))[:num_layers])
    if cfg.model_type != "nemotron_h":  # nemotron derives num_hidden_layers from layers_block_type
        cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "mlp_only_layers", None), list):
        cfg.mlp_only_layers = [i for i in cfg.mlp_only_layers if i < num_layers]
    assert cfg.num_hidden_layers == num_layers
    return cfg


def hf_config(spec: ModelSpec):
    """The transformers config of the causal LM a spec runs, with ``spec.num_layers`` applied: a multimodal
    wrapper's text config (Qwen3.5's ``text_config``), so every engine and metric sees one text model; the
    checkpoint on disk keeps the wrapper (spec/checkpoint.py)."""
    from transformers import AutoConfig

    if spec.path is not None:
        if not (Path(spec.path) / "config.json").is_file():
            raise InputError(
                f"{spec.path} has no config.json; for a zoo model run "
                f"`python -m lpdiff.harness.build.zoo build --name {spec.name}`"
            )
        cfg = AutoConfig.from_pretrained(spec.path)
    else:
        assert spec.config is not None  # a ModelSpec has a path or a config
        kw = dict(spec.config)
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    if getattr(cfg, "text_config", None) is not None:
        cfg = cfg.get_text_config()
    if spec.num_layers is not None:
        cfg = with_num_layers(cfg, spec.num_layers)
    return cfg


def load_hf_model(spec: ModelSpec, dtype: torch.dtype, device: str | torch.device):
    """The transformers model of a spec, in eval mode, on ``device`` in ``dtype``.

    Checkpoint directories load with ``from_pretrained`` (layers past ``num_layers`` are left on disk); config
    specs are built directly on the device with their seeded recipe (``INIT_RECIPES``; deterministic per seed and
    device type). Engines that load directories get this same model written by spec/checkpoint.py."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(spec)
    # Prompt logprobs need one prefill and no cache; a nemotron prefix without attention layers (num_layers=4:
    # "MEME") even fails to build one (transformers 5.17 asks a cache of mamba layers for its length).
    cfg.use_cache = False
    if spec.path is not None:
        model = AutoModelForCausalLM.from_pretrained(spec.path, config=cfg, dtype=dtype, device_map=str(device))
    else:
        if spec.init_recipe not in INIT_RECIPES:
            raise SpecError(
                f"model {spec.name}: init recipe {spec.init_recipe!r} is unknown to this lpdiff (it "
                f"builds {', '.join(INIT_RECIPES)}); regenerate the baseline or upgrade lpdiff"
            )
        assert spec.init_seed is not None  # a config-built ModelSpec has a seed
        torch.manual_seed(spec.init_seed)
        with torch.device(device):
            model = _causal_lm_class(cfg)._from_config(cfg, dtype=INIT_DTYPE)
        report = apply_peaked(model, moe_fields(cfg), spec.init_seed) if spec.init_recipe == PEAKED else {}
        model = model.to(dtype)
        # what was built, for spec/checkpoint.py to check against the spec it writes and to record beside it
        model.init_report = {"recipe": spec.init_recipe, "seed": spec.init_seed, "device": str(device), **report}
    return model.eval()


# -- normalised MoE facts ------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class MoeFields:
    """The MoE structure of a config, whatever the architecture calls its fields."""

    arch: str
    hidden: int
    num_layers: int
    moe_layers: tuple[int, ...]  # indices of layers whose MLP is routed experts
    num_experts: int = 0
    top_k: int = 0
    expert_width: int = 0  # per-expert intermediate size
    shared_width: int = 0  # 0: no shared expert
    shared_gate: bool = False  # shared expert output scaled by sigmoid(Linear(hidden, 1)) (qwen3.5)
    activation: str = "silu"  # "silu" (SwiGLU) | "swiglu_oai" (gpt-oss clamped) | "relu2" (non-gated)
    gated: bool = True  # experts have gate and up projections
    gate_up_interleaved: bool = False  # gate = gate_up[..., ::2], up = gate_up[..., 1::2] (gpt-oss)
    experts_transposed: bool = False  # fused weights stored (E, in, out) instead of (E, out, in) (gpt-oss)
    expert_bias: bool = False
    router: str = "softmax"  # "softmax" (top-k of softmax) | "topk_softmax" (softmax of top-k logits) | "sigmoid"
    router_bias: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    latent_size: int | None = None  # Nemotron-Super latent MoE projections
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def __post_init__(self):
        assert self.activation in ("silu", "swiglu_oai", "relu2"), self.activation
        assert self.router in ("softmax", "topk_softmax", "sigmoid"), self.router
        if self.moe_layers:
            assert self.num_experts >= self.top_k >= 1 and self.expert_width > 0

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def moe_fields(config) -> MoeFields:
    """Normalise any supported transformers config (or its multimodal wrapper) to ``MoeFields``."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch, n, hidden = cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size
    base = dict(arch=arch, hidden=hidden, num_layers=n)
    if arch == "qwen3":
        return MoeFields(moe_layers=(), **base)
    num_experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = cfg.num_experts_per_tok
    if arch == "qwen3_moe":
        step, dense = cfg.decoder_sparse_step, set(cfg.mlp_only_layers or [])
        layers = tuple(i for i in range(n) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        return MoeFields(
            moe_layers=layers,
            num_experts=num_experts,
            top_k=top_k,
            expert_width=cfg.moe_intermediate_size,
            norm_topk_prob=bool(cfg.norm_topk_prob),
            **base,
        )
    if arch in ("qwen3_5_moe_text", "qwen3_next"):
        return MoeFields(
            moe_layers=tuple(range(n)),
            num_experts=num_experts,
            top_k=top_k,
            expert_width=cfg.moe_intermediate_size,
            shared_width=cfg.shared_expert_intermediate_size,
            shared_gate=True,
            norm_topk_prob=True,
            **base,
        )
    if arch == "gpt_oss":
        return MoeFields(
            moe_layers=tuple(range(n)),
            num_experts=num_experts,
            top_k=top_k,
            expert_width=cfg.intermediate_size,
            activation="swiglu_oai",
            gate_up_interleaved=True,
            experts_transposed=True,
            expert_bias=True,
            router="topk_softmax",
            router_bias=True,
            norm_topk_prob=True,
            swiglu_alpha=1.702,
            swiglu_limit=float(getattr(cfg, "swiglu_limit", 7.0)),
            **base,
        )
    if arch == "nemotron_h":
        layers = tuple(i for i, t in enumerate(cfg.layers_block_type) if t == "moe")
        shared = cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts if cfg.n_shared_experts else 0
        return MoeFields(
            moe_layers=layers,
            num_experts=num_experts,
            top_k=top_k,
            expert_width=cfg.moe_intermediate_size,
            shared_width=shared,
            activation="relu2",
            gated=False,
            router="sigmoid",
            norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=float(cfg.routed_scaling_factor),
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            latent_size=cfg.moe_latent_size,
            **base,
        )
    raise NotImplementedError(
        f"moe_fields does not know model_type {arch!r}; supported: qwen3, qwen3_moe, "
        "qwen3_5_moe_text, gpt_oss, nemotron_h"
    )


# -- description ---------------------------------------------------------------------------------------------------


def _causal_lm_class(cfg) -> type[PreTrainedModel]:
    """transformers' causal-LM class of a config (its auto mapping's stub types the value as a tuple)."""
    from transformers import AutoModelForCausalLM

    return cast("type[PreTrainedModel]", AutoModelForCausalLM._model_mapping[type(cfg)])


def count_params(cfg) -> int:
    """Parameter count without allocating weights (the model is built on the meta device)."""
    with torch.device("meta"):
        model = _causal_lm_class(cfg)._from_config(cfg, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def describe(spec: ModelSpec) -> dict[str, Any]:
    """One row of ``lpdiff models``."""
    cfg = hf_config(spec)
    m = moe_fields(cfg)
    text = cfg.get_text_config()
    return {
        "name": spec.name,
        "arch": m.arch,
        "source": spec.path or f"config (seed {spec.init_seed}, {spec.init_recipe})",
        "hidden": m.hidden,
        "layers": m.num_layers,
        "moe_layers": len(m.moe_layers),
        "experts": m.num_experts,
        "top_k": m.top_k,
        "expert_width": m.expert_width,
        "shared_expert": m.shared_width,
        "activation": m.activation,
        "heads": text.num_attention_heads,
        "kv_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "vocab": text.vocab_size,
        "params": count_params(cfg),
    }
