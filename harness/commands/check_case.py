"""The case ``lpdiff check`` judges (commands/check.py): a full-width, reduced-depth model built from a catalog config,
its adapters generated with fixed seeds (``ADAPTERS``; the hybrids' own groups in ``HYBRID_ADAPTERS``) and written
in every expert layout an engine reads, and its prompts; ``served_files`` picks the files one engine is served."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lpdiff.engines import ENGINES
from lpdiff.engines.base import capabilities, layouts_for
from lpdiff.engines.capabilities import model_type
from lpdiff.harness.types import AdapterSpec, ModelSpec

PROMPT_LENGTHS = (256, 131, 200, 64, 256, 97, 180, 33)


@dataclass(slots=True, frozen=True)
class AdapterPlan:
    name: str
    groups: tuple[str, ...]
    rank: int
    seed: int
    broken_from: str | None = None  # the correct adapter this one is a broken copy of (the reference runs that)
    # trainers' forms (generate_adapter's): rsLoRA, PEFT rank_pattern / alpha_pattern as (key, value) pairs
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @property
    def expected(self) -> str:
        return "FAIL" if self.broken_from else "PASS"


ADAPTERS = (
    AdapterPlan("all", ("attention", "experts"), 16, 1),
    AdapterPlan("attention", ("attention",), 16, 2),
    AdapterPlan("experts", ("experts",), 16, 3),
    AdapterPlan("all_r8", ("attention", "experts"), 8, 4),  # below the max rank (16) the engine is started with
    AdapterPlan("broken", ("attention", "experts"), 16, 1, broken_from="all"),
)


# the hybrids: one adapter per module group of theirs beside the groups every engine serves, so that a dropped
# group is named by its own lane; "all" holds the groups vLLM and SGLang both read (SGLang has no LoRA for HF's
# GDN projections nor a PEFT-shaped mamba in_proj: those lanes are served where the engine reads them)
_HYBRID_COMMON = ("attention", "shared_expert", "experts")
HYBRID_ADAPTERS = {
    arch: (
        AdapterPlan("all", _HYBRID_COMMON, 16, 1),
        AdapterPlan("all_groups", (*_HYBRID_COMMON, own), 16, 8),  # every group together, where the engine reads them
        AdapterPlan(own, (own,), 16, 2),
        AdapterPlan("attention", ("attention",), 16, 5),
        AdapterPlan("shared_expert", ("shared_expert",), 16, 6),
        AdapterPlan("experts", ("experts",), 16, 3),
        AdapterPlan("all_r8", _HYBRID_COMMON, 8, 4),
        AdapterPlan("broken", _HYBRID_COMMON, 16, 1, broken_from="all"),
        AdapterPlan(
            "latent", ("latent",), 16, 7
        ),  # Nemotron-3-Super's latent MoE projections (where the model has them)
    )
    for arch, own in (("qwen3_5_moe", "linear_attention"), ("nemotron_h", "mamba"))
}


def plans_for(arch: str) -> tuple[AdapterPlan, ...]:
    return HYBRID_ADAPTERS.get(model_type(arch), ADAPTERS)


def trainer_plans_for(arch: str) -> tuple[AdapterPlan, ...]:
    """The adapters trainers write (issue 42), beside the arch's "all" and "broken" lanes: rsLoRA with rank/alpha
    patterns (keys that name a module suffix on every arch), lm_head + embed_tokens alone and with the decoder groups,
    embed_tokens alone, rank 128 (vLLM 0.25.1's MoE-LoRA limit) and 256 (above it: doctor refuses it for vLLM,
    moe-rank-above-128). Each engine is served the lanes doctor does not refuse for it."""
    base = plans_for(arch)
    decoder = next(p.groups for p in base if p.name == "all")
    return (
        *(p for p in base if p.name in ("all", "broken")),
        AdapterPlan(
            "rslora_patterns",
            decoder,
            16,
            11,
            use_rslora=True,
            rank_pattern=(("q_proj", 8), ("experts.down_proj", 4)),
            alpha_pattern=(("o_proj", 6.0), ("experts.down_proj", 40.0)),
        ),
        AdapterPlan("vocab", ("lm_head", "embed_tokens"), 16, 12),
        # embed_tokens alone: an engine that cannot serve lm_head LoRA (vLLM: vllm-lm-head-prompt-logprobs) is still
        # judged on its embedding LoRA
        AdapterPlan("embed", ("embed_tokens",), 16, 16),
        AdapterPlan("all_vocab", (*decoder, "lm_head", "embed_tokens"), 16, 13, use_rslora=True),
        AdapterPlan("rank128", decoder, 128, 14),
        AdapterPlan("rank256", decoder, 256, 15),
    )


def make_prompts(vocab_size: int, lengths: Sequence[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@dataclass(slots=True)
class Case:
    """One model with its adapters (PEFT 3D for the reference, every engine layout) and prompts."""

    spec: ModelSpec
    plans: dict[str, AdapterPlan]
    files: dict[tuple[str, str], AdapterSpec]  # (adapter, layout) -> directory
    prompts: list[list[int]]


def build_case(
    model: str,
    layers: int,
    root: str | Path,
    plans: Sequence[AdapterPlan] | None = None,
    layouts: Sequence[str] | None = None,
    device: str = "cuda",
    lengths: Sequence[int] = PROMPT_LENGTHS,
    log: Callable[[str], None] = print,
    init_recipe: str | None = None,
) -> Case:
    """``plans``: default ``plans_for`` the model; ``layouts``: default every layout an engine reads on it;
    ``init_recipe``: a config-built model's weights (catalog.INIT_RECIPES; default: catalog's choice)."""
    import torch

    from lpdiff.harness.spec.adapters import LAYOUTS, ModelLayout, convert_adapter, generate_adapter, module_group
    from lpdiff.harness.spec.catalog import get_model, hf_config, load_hf_model
    from lpdiff.harness.spec.mutations import permute_experts

    spec = get_model(model, num_layers=layers, init_recipe=init_recipe)
    if layouts is None:
        layouts = [lay for lay in LAYOUTS if any(lay in layouts_for(e, spec.arch) for e in ENGINES)]
    root = Path(root)
    t0 = time.perf_counter()
    hf = load_hf_model(spec, torch.bfloat16, device)  # only its weights' RMS sizes the adapters
    log(f"[check] {model} x{layers} layers ({spec.init_recipe}): model built in {time.perf_counter() - t0:.1f}s")
    if plans is None:  # the model's plans whose groups it has (a latent lane only where there are latent layers)
        lay = ModelLayout.of(hf)
        present = {module_group(n) for n in [*lay.linears, *lay.experts]}
        plans = [p for p in plans_for(spec.arch) if set(p.groups) <= present]
    cfg = hf_config(spec)
    files: dict[tuple[str, str], AdapterSpec] = {}
    for p in plans:
        d3 = root / f"{p.name}.peft3d"
        if p.broken_from:
            permute_experts(files[(p.broken_from, "peft3d")].path, d3)
            files[(p.name, "peft3d")] = AdapterSpec(d3.name, str(d3))
        else:
            files[(p.name, "peft3d")] = generate_adapter(
                hf,
                d3,
                groups=p.groups,
                rank=p.rank,
                alpha=2 * p.rank,
                seed=p.seed,
                use_rslora=p.use_rslora,
                rank_pattern=dict(p.rank_pattern),
                alpha_pattern=dict(p.alpha_pattern),
            )
        for layout in layouts:
            if layout != "peft3d":
                dst = root / f"{p.name}.{layout}"
                files[(p.name, layout)] = convert_adapter(d3, dst, layout, cfg)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"[check] {model} x{layers} layers: {len(files)} adapter files in {time.perf_counter() - t0:.1f}s")
    return Case(spec, {p.name: p for p in plans}, files, make_prompts(cfg.vocab_size, lengths))


def case_layers(case: Case) -> int:
    """The decoder layers the case's model runs (its cut, else the config's depth)."""
    if case.spec.num_layers:
        return case.spec.num_layers
    from lpdiff.harness.spec.catalog import hf_config

    return int(getattr(hf_config(case.spec), "num_hidden_layers", 1) or 1)


def served_files(case: Case, engine: str, layouts: Sequence[str]) -> dict[str, AdapterSpec]:
    """The lanes (``name.layout`` -> directory) served to ``engine``: the case's files in ``layouts``, or, where the
    engine maps adapter names from its checkpoint's decoder root (``adapter_root``: vLLM on Qwen3.5's wrapper),
    copies written under that root, once per case (``<case dir>/<engine>-root/``) so every TP size reuses them. The
    reference keeps the text model's names, which transformers builds."""
    from lpdiff.harness.spec.adapters import ModelLayout
    from lpdiff.harness.spec.catalog import hf_config

    root = capabilities(engine).adapter_root(case.spec.arch)
    mlayout, lanes = None, {}
    for (name, layout), a in case.files.items():
        if layout not in layouts:
            continue
        path = Path(a.path)
        if root is not None:
            dst = path.parent / f"{engine}-root" / path.name
            if not dst.is_dir():  # renamed into place whole (_rerooted)
                if mlayout is None:
                    mlayout = ModelLayout.from_config(hf_config(case.spec))
                _rerooted(path, dst, layout, mlayout, root)
            path = dst
        lanes[f"{name}.{layout}"] = AdapterSpec(f"{name}.{layout}", str(path))
    return lanes


def _rerooted(src: Path, dst: Path, layout: str, mlayout, root: str) -> None:
    """``src`` written under decoder root ``root`` into a private directory renamed to ``dst``: processes sharing a
    case dir never see half a copy."""
    import os
    import shutil

    from lpdiff.harness.spec.adapters import convert_adapter

    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_adapter(src, tmp, layout, mlayout, disk_root=root)
    try:
        tmp.rename(dst)
    except OSError:  # another process wrote it meanwhile: the same content
        shutil.rmtree(tmp, ignore_errors=True)
