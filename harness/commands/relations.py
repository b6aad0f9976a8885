"""Metamorphic relations: each turns the adapter (or the engine's settings, or the batch) into lanes that must give
the same logprobs as their reference lane; ``RELATIONS`` names them. Lanes that do not apply say why."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lpdiff.harness.spec.adapters import CanonicalAdapter, ModelLayout, merge_into, save_canonical
from lpdiff.harness.spec.transforms import (
    pad_rank,
    reparametrise,
    rescale_alpha,
    shared_outer,
    split_gate_up,
    strip_zero_rank,
    zero_b,
)
from lpdiff.harness.types import ModelSpec

# alone: every prompt with the lane's adapter in one call; beside_other: the same, in an engine that also holds a
# different adapter of twice the rank; mixed: each prompt's row next to a base row and an other-adapter row in one
# call; permuted: the mixed rows shuffled; single: one call per prompt; tripled: every prompt three times with the
# lane's adapter (the mixed batch's size without its other adapters: tells a batch-size effect from a mixing one);
# among_adapters: each prompt's row beside one row per adapter of the session (the original, the neighbour and
# Context.neighbours), its place among them rotating from prompt to prompt; among_base: among_adapters' batch, row
# for row, with every row run without adapter (a LoRA-disabled session's reference for among_adapters)
ARRANGEMENTS = ("alone", "beside_other", "mixed", "permuted", "single", "tripled", "among_adapters", "among_base")
ORIG, OTHER = "orig", "other"  # adapter names of the original adapter and the unrelated neighbour in batches


# -- lanes and relations -------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Lane:
    """One way of running the prompts. ``reference``: "orig" (the original adapter lane), "base", the name of
    another lane of the same relation, or "" (run only as another lane's reference). ``session`` groups lanes that
    share one engine (same model, options, TP)."""

    name: str  # relation:variant, e.g. "format:per_expert"
    adapter: str | None  # adapter directory, or None for the base model
    reference: str = ORIG
    arrangement: str = "alone"  # one of ARRANGEMENTS
    session: str = "transformed"
    model: ModelSpec | None = None  # None: the original model
    options: str = "{}"  # engine options (JSON) merged over the user's
    tp: int | None = None
    exact: bool = False
    reruns: int = 1  # > 1: the lane's own rerun noise joins the bound (a mode may be less deterministic: TP n)

    def __post_init__(self):
        assert self.arrangement in ARRANGEMENTS, self.arrangement
        assert self.reruns >= 1, self.reruns


@dataclass(slots=True)
class Context:
    engine: str
    spec: ModelSpec
    hf_config: object
    layout: ModelLayout
    adapter: CanonicalAdapter
    adapter_dir: Path
    tmp: Path
    dtype: str = "float32"
    tp: int = 1
    options: dict = field(default_factory=dict)
    seed: int = 0
    log: Callable[[str], None] = lambda s: None
    refusals: dict[str, str | None] = field(default_factory=dict)  # adapter dir -> refused()'s answer
    # more adapters (name -> directory) that sessions with among_adapters lanes hold beside the original and the
    # neighbour: the GPU grid's adapter lanes, so that neutrality sees base rows beside every one of them
    neighbours: dict[str, str] = field(default_factory=dict)

    def write(self, name: str, adapter: CanonicalAdapter, layout: str | None = None) -> str:
        """Transformed adapters keep the original's expert layout (the one the engine was given because it reads
        it), unless a relation asks for another, and are named under the decoder root the engine reads (vLLM drops
        Qwen3.5 adapters named like the text model: vllm-qwen3.5-text-names)."""
        from lpdiff.engines.base import capabilities

        out = self.tmp / name
        if layout is None:
            layout = self.adapter.layout if self.adapter.layout in ("peft3d", "per_expert") else "peft3d"
        root = capabilities(self.engine).adapter_root(self.spec.arch)
        save_canonical(adapter, out, self.layout, layout, disk_root=root)
        return str(out)

    def refused(self, adapter_dir: str) -> str | None:
        """refusal() for this engine, asked once per adapter directory."""
        if adapter_dir not in self.refusals:
            self.refusals[adapter_dir] = refusal(self.spec, self.engine, adapter_dir)
        return self.refusals[adapter_dir]


def refusal(spec: ModelSpec, engine: str, adapter_dir: str | Path) -> str | None:
    """doctor's first error for this engine on this adapter (pipeline.doctor.refusals, for every engine): the engine
    refuses or drops it (known limit), or the adapter does not fit the model."""
    from lpdiff.harness.pipeline.doctor import refusals

    errors = refusals(spec, adapter_dir, engine).errors
    return f"doctor [{errors[0].code}]: {errors[0].message}" if errors else None


@dataclass(slots=True, frozen=True)
class Relation:
    name: str
    why: str
    lanes: Callable[[Context], list[Lane] | str]  # a str says why the relation does not apply


def merged_checkpoint(ctx: Context, out: Path) -> ModelSpec:
    """The base model with every delta merged in, saved as a checkpoint in the run dtype (config-built models
    are built on the device they run on: the init's random stream is the device's)."""
    from lpdiff.harness.spec.catalog import load_hf_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_model(ctx.spec, torch.float32, device)
    merge_into(model, ctx.adapter)
    model.config.use_cache = True
    model.to(getattr(torch, ctx.dtype)).save_pretrained(str(out))
    del model
    if ctx.spec.path is not None:  # engines that start from a directory may want the tokenizer beside it
        for f in Path(ctx.spec.path).glob("tokenizer*"):
            shutil.copy(f, out / f.name)
    return ModelSpec(name=f"{ctx.spec.name}+merged", arch=ctx.spec.arch, path=str(out))


# -- the relations -------------------------------------------------------------------------------------------------


def _needs_experts(ctx: Context) -> str | None:
    return None if ctx.adapter.experts else "the adapter has no expert LoRA: both expert layouts are the same file"


def _format(ctx: Context):
    if (why := _needs_experts(ctx)) is not None:
        return why
    written = [
        (f"format:{layout}", ctx.write(f"format-{layout}", ctx.adapter, layout))
        for layout in ("per_expert", "peft3d")
        if ctx.adapter.layout != layout
    ]
    so = ctx.adapter.rank * ctx.layout.experts[next(iter(ctx.adapter.experts))].num_experts
    not_written = []
    from lpdiff.engines.base import max_rank

    limit = max_rank(ctx.engine)
    if limit is not None and so > limit:
        not_written.append(
            f"format:shared_outer: the exact shared-outer form needs rank E*r = {so} > {limit}, "
            f"more than {ctx.engine} accepts"
        )
    else:
        written.append(("format:shared_outer", ctx.write("format-shared_outer", shared_outer(ctx.adapter, ctx.layout))))
    # an engine limit doctor knows (e.g. vLLM's MoE-LoRA rank cap) makes a lane n/a instead of killing the session
    return [
        f"{name}: {ctx.refused(path)}" if ctx.refused(path) else Lane(name, path) for name, path in written
    ] + not_written


def _rank(ctx: Context):
    r = max(ctx.adapter.inner_dims | {ctx.adapter.rank})
    padded = ctx.write("rank-pad", pad_rank(ctx.adapter, 2 * r))
    # the original adapter in an engine that also holds a rank-2r adapter: a loaded rank below the max rank
    return [
        Lane(f"rank:pad_{r}_to_{2 * r}", padded),
        Lane(f"rank:loaded_{r}_below_max_{2 * r}", str(ctx.adapter_dir), arrangement="beside_other"),
    ]


def _factors(ctx: Context):
    return [
        Lane("factors:M_A_B_Minv", ctx.write("factors-reparam", reparametrise(ctx.adapter, ctx.seed))),
        Lane("factors:alpha_x4_B_div4", ctx.write("factors-alpha", rescale_alpha(ctx.adapter, 4.0))),
    ]


def _gate_up(ctx: Context):
    if (why := _needs_experts(ctx)) is not None:
        return why
    split = split_gate_up(ctx.adapter, ctx.layout, ctx.seed + 1)
    if split is None:
        return f"the experts of {ctx.spec.arch} are not gated (no gate/up pair)"
    shared_a = ctx.write("gate_up-stacked-per_expert", split, "per_expert")
    forms = [
        ("gate_up:stacked_2r_peft3d", ctx.write("gate_up-stacked-peft3d", split, "peft3d")),
        ("gate_up:stacked_2r_per_expert", shared_a),
        ("gate_up:per_projection_A", str(strip_zero_rank(shared_a, ctx.tmp / "gate_up-per_projection"))),
    ]
    # the first form the engine loads is the others' reference (SGLang dies on PEFT 3D, vLLM's gpt-oss misreads
    # per-expert files: doctor refuses those, and the relation holds among the forms that remain)
    lanes: list = []
    ref = ""
    for name, path in forms:
        if why := ctx.refused(path):
            lanes.append(f"{name}: {why}")
            continue
        lanes.append(Lane(name, path, reference=ref))
        ref = ref or name
    if sum(isinstance(x, Lane) for x in lanes) < 2:
        return "the engine loads fewer than two forms of the split adapter: " + "; ".join(
            x for x in lanes if isinstance(x, str)
        )
    return lanes


def _merged(ctx: Context):
    spec = merged_checkpoint(ctx, ctx.tmp / "merged-model")
    return [Lane("merged:base_plus_delta", None, model=spec, session="merged")]


def _zero_b(ctx: Context):
    # against base rows of the same engine session: the session's other adapters may set kernels for every row (a
    # larger max rank; triton's torch fallback above the kernels' rank cap), which is not what this relation tests
    return [
        Lane("zero_b:base_rows", None, reference="", session="transformed"),
        Lane("zero_b:vs_base", ctx.write("zero-b", zero_b(ctx.adapter)), reference="zero_b:base_rows", exact=True),
    ]


def _batch(ctx: Context):
    d = str(ctx.adapter_dir)
    return [
        Lane("batch:mixed", d, arrangement="mixed", session="transformed"),
        Lane("batch:permuted", d, arrangement="permuted", session="transformed"),
        Lane("batch:size_1", d, arrangement="single", session="original"),
        Lane("batch:tripled", d, arrangement="tripled", session="transformed"),
    ]


def _neutral(ctx: Context):
    """LoRA neutrality: base rows of a LoRA-enabled engine (one holding the original, the neighbour and
    Context.neighbours), alone and each beside a row of every adapter, against a LoRA-disabled engine of the same
    build (a session with no adapters: EngineConfig.adapters empty, the engines start without LoRA). Exact: bit
    for bit where reruns are (triton, HF, SGLang), within the rerun noise where LoRA runs are not (vLLM).

    The mixed batch's reference is the batch the engine really ran its base rows in: that batch row for row without
    adapters (among_base) where one forward runs every row (Capabilities.mixed_batches), the base rows alone where
    the engine runs them as their own batch (HF+PEFT groups rows by adapter). A row's bits may depend on its batch's
    row count, LoRA or not: on CPU (MKL's sgemm, torch's vectorised activations) the triton runtime's base rows in the
    56-row mixed batch differed from an 8-row LoRA-off batch by 9.5e-7 (tiny Nemotron-H and Qwen3.5, 8 prompts), and
    HF's 8-row base group from a 56-row LoRA-off batch split at a 200-1000-token step by up to 4.3e-6 (all four tiny
    MoE models): the other engine's reference would be a false FAIL about batch size, not LoRA."""
    from lpdiff.engines.base import capabilities

    caps = capabilities(ctx.engine)
    if ctx.layout.experts and not caps.moe_lora_cpu and _cuda(ctx):
        return f"{caps.label} runs MoE models with LoRA only on a GPU ({_cuda(ctx)})"
    among_ref = "neutral:lora_off_among" if caps.mixed_batches else "neutral:lora_off"
    lanes = [Lane("neutral:lora_off", None, reference="", session="neutral:lora_off")]
    if caps.mixed_batches:
        lanes.append(Lane(among_ref, None, reference="", arrangement="among_base", session="neutral:lora_off"))
    return [
        *lanes,
        Lane("neutral:base_alone", None, reference="neutral:lora_off", session="neutral:lora_on", exact=True, reruns=2),
        Lane(
            "neutral:base_among_adapters",
            None,
            reference=among_ref,
            arrangement="among_adapters",
            session="neutral:lora_on",
            exact=True,
            reruns=2,
        ),
    ]


def _cuda(ctx: Context, need: int = 1) -> str | None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return None if have >= need else f"needs {need} GPU(s), this machine has {have}"


def _moe(ctx: Context) -> str | None:
    return None if ctx.layout.experts else "the model has no experts"


def _bf16_cuda(ctx: Context) -> str | None:
    return _cuda(ctx) or (None if ctx.dtype != "float32" else "FlashAttention runs bf16/fp16 only")


def _interpreter_or_cuda(ctx: Context) -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return _cuda(ctx) and "Triton kernels need CUDA (or TRITON_INTERPRET=1, slow)"


def _tp_applies(engine: str, n: int):
    from lpdiff.engines.base import capabilities

    def applies(ctx: Context) -> str | None:
        if ctx.tp != 1:
            return "the run is already tensor-parallel"
        if n == 2 and n in capabilities(engine).cpu_tp and not torch.cuda.is_available():
            return None  # gloo on CPU (triton): a real test of the sharding math; TP 2 is the smallest split
        return _cuda(ctx, n)

    return applies


# what a mode's ``needs`` (engines' capabilities, MODE_NEEDS) asks of this run -> None, or why it cannot run here
NEEDS: dict[str, Callable[[Context], str | None]] = {
    "experts": _moe,
    "cuda": _cuda,
    "low_precision": _bf16_cuda,
    "triton_kernels": _interpreter_or_cuda,
}


def _applies(needs: Sequence[str]) -> Callable[[Context], str | None]:
    def applies(ctx: Context) -> str | None:
        return next((why for n in needs if (why := NEEDS[n](ctx))), None)

    return applies


def engine_modes_table() -> dict[str, dict[str, tuple[dict, int | None, Callable]]]:
    """engine -> variant -> (options, tp, applies(ctx) -> None or why not), from each engine's capabilities."""
    from lpdiff.engines import ENGINES
    from lpdiff.engines.base import engine_modes

    return {
        e: {name: (dict(m.options), None, _applies(m.needs)) for name, m in engine_modes(e).items()} for e in ENGINES
    }


def tp_sizes_table() -> dict[str, dict[str, tuple[dict, int | None, Callable]]]:
    """engine -> TP size -> ({}, tp, applies): TP 2 and 4 for every engine that declares them (Capabilities.tp)."""
    from lpdiff.engines import ENGINES
    from lpdiff.engines.base import capabilities

    return {
        e: {str(n): ({}, n, _tp_applies(e, n)) for n in (2, 4) if n in capabilities(e).tp}
        for e in ENGINES
        if any(n in capabilities(e).tp for n in (2, 4))
    }


def _variant_lanes(ctx: Context, relation: str, table: dict, session: str):
    """One engine session per variant (options, TP), holding the adapter lane and a base lane, each run twice."""
    variants = table.get(ctx.engine)
    if not variants:
        return f"no {relation} variants are known for engine {ctx.engine!r}"
    lanes: list = []
    for variant, (opts, tp, applies) in variants.items():
        if why := applies(ctx):
            lanes.append(f"{relation}:{variant}: {why}")
            continue
        merged_opts = json.dumps(opts, sort_keys=True)
        for adapter, ref, tag in ((str(ctx.adapter_dir), ORIG, "lora"), (None, "base", "base")):
            lanes.append(
                Lane(
                    f"{relation}:{variant}:{tag}",
                    adapter,
                    reference=ref,
                    session=f"{session}:{variant}",
                    options=merged_opts,
                    tp=tp,
                    reruns=2,
                )
            )
    return lanes


def _modes(ctx: Context):
    return _variant_lanes(ctx, "mode", engine_modes_table(), "mode")


def _tp(ctx: Context):
    return _variant_lanes(ctx, "tp", tp_sizes_table(), "tp")


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in [
        Relation("format", "PEFT 3D <-> per-expert keys <-> shared-outer: one delta, three files", _format),
        Relation("rank", "zero-padded rank, and a rank below the engine's max rank", _rank),
        Relation("factors", "A -> M·A, B -> B·M⁻¹; alpha changed with B rescaled", _factors),
        Relation("gate_up", "different gate/up As: per-projection vs rank-2r stacked", _gate_up),
        Relation("merged", "delta merged into the base weights, no adapter", _merged),
        Relation("zero_b", "an all-zero B is the base model, exactly", _zero_b),
        Relation("batch", "the adapter's rows mixed with others, permuted, batch size 1", _batch),
        Relation("modes", "engine switches that must not change the math", _modes),
        Relation("tp", "TP 2 and 4 against TP 1, each judged with its own rerun noise", _tp),
        Relation(
            "neutral",
            "base rows of a LoRA-enabled engine, alone and beside every adapter, = a LoRA-disabled one",
            _neutral,
        ),
    ]
}
