"""Writing a canonical adapter as a PEFT directory in either expert layout, and exact conversion between layouts
(the rank change and its reason recorded in the provenance file)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lpdiff.harness.spec.adapters.canonical import CanonicalAdapter, as_layout, load_canonical, peft_scaling
from lpdiff.harness.spec.adapters.files import (
    CONFIG_NAME,
    PROVENANCE_NAME,
    WEIGHTS_NAME,
    read_provenance,
    save_tensors,
    write_json,
)
from lpdiff.harness.spec.adapters.inspection import several
from lpdiff.harness.spec.adapters.layout import LAYOUTS, PEFT_PREFIX, disk_roots, suffixes
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import AdapterSpec


def _rerank(adapter: CanonicalAdapter) -> tuple[int, float]:
    """One rank for every entry (engines take one per adapter): the largest inner dimension, with alpha chosen so
    the scaling stays bit-identical. Refuses when no alpha gives exactly the same scaling."""
    new_rank = max(adapter.inner_dims | {adapter.rank})
    if new_rank == adapter.rank:
        return adapter.rank, adapter.alpha
    ratio = new_rank / adapter.rank
    alpha = adapter.alpha * (math.sqrt(ratio) if adapter.use_rslora else ratio)
    if peft_scaling(alpha, new_rank, adapter.use_rslora) != adapter.scaling:
        raise InputError(
            f"this adapter needs rank {new_rank} (from {adapter.rank}) in one file, but no lora_alpha "
            f"gives exactly the same scaling {adapter.scaling!r}{' with rslora' if adapter.use_rslora else ''}"
            "; refusing to approximate. Use the source adapter as it is."
        )
    return new_rank, alpha


def _pad(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows of A and zero columns of B up to `rank`: B @ A is unchanged exactly."""
    extra = rank - a.shape[-2]
    if extra == 0:
        return a, b
    a_pad = torch.cat([a, a.new_zeros(*a.shape[:-2], extra, a.shape[-1])], dim=-2)
    b_pad = torch.cat([b, b.new_zeros(*b.shape[:-1], extra)], dim=-1)
    return a_pad, b_pad


def save_canonical(
    adapter: CanonicalAdapter,
    out_dir: str | Path,
    model_config,
    layout: str = "peft3d",
    disk_root: str | None = None,
    provenance: dict | None = None,
) -> dict[str, Any]:
    """Write a canonical adapter as a PEFT-format directory in `layout`. Entries of different inner dimensions
    are zero-padded to one rank with alpha adjusted (exactly; see _rerank), or, for an adapter whose entries have
    their own scalings, written at their own ranks with rank_pattern / alpha_pattern (_plan_ranks). `disk_root`:
    write the decoder under this name instead of ``model`` (e.g. "backbone" for Nemotron-H's on-disk names).
    Returns the written config."""
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    mlayout = as_layout(model_config)
    roots = disk_roots(mlayout.model_type)
    if disk_root is not None and disk_root.rstrip(".") not in roots:
        raise InputError(
            f"disk root {disk_root!r}: a {mlayout.model_type} adapter names its decoder "
            f"{' or '.join(roots)}, which lpdiff and the engines read; give one of those"
        )
    rank, alpha, written, rank_pattern, alpha_pattern = _plan_ranks(adapter)
    root = "model." if disk_root is None else disk_root.rstrip(".") + "."

    def key(path: str, which: str, suffix: str = ".weight") -> str:
        if path.startswith("model."):  # under the decoder root; lm_head is outside it
            path = root + path[len("model.") :]
        return f"{PEFT_PREFIX}{path}.lora_{which}{suffix}"

    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b) in adapter.dense.items():
        a, b = _pad(a, b, written[name])
        tensors[key(name, "A")], tensors[key(name, "B")] = a, b
    for name, (a, b) in adapter.embed.items():
        a, b = _pad(a, b, written[name])
        tensors[key(name, "embedding_A", "")], tensors[key(name, "embedding_B", "")] = a, b
    expert_names: set[str] = set()
    target_parameters: list[str] = []
    for name, (a, b) in adapter.experts.items():
        p = mlayout.experts[name]
        a, b = _pad(a, b, written[name])
        if layout == "peft3d":
            names = [n for n in mlayout.module_params[p.module] if f"{p.module}.{n}" in adapter.experts]
            nest = ".base_layer" * (len(names) - 1 - names.index(p.name))
            tensors[key(p.module + nest, "A")] = a.reshape(-1, a.shape[-1])
            tensors[key(p.module + nest, "B")] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
            target_parameters.append(name)
        else:
            for part, rows in zip(p.disk_parts(layout), p.part_rows()):
                expert_names.add(part)
                for e in range(p.num_experts):
                    tensors[key(f"{p.module}.{e}.{part}", "A")] = a[e].clone()  # gate and up share A
                    tensors[key(f"{p.module}.{e}.{part}", "B")] = b[e, rows]

    cfg = dict(adapter.config)
    cfg.update(
        r=rank,
        lora_alpha=alpha,
        rank_pattern=_pattern(rank_pattern, mlayout, layout),
        alpha_pattern=_pattern(alpha_pattern, mlayout, layout),
        peft_type="LORA",
    )
    dense = sorted([*adapter.dense, *adapter.embed])
    cfg["target_modules"] = sorted(
        set(suffixes(dense, [*mlayout.linears, *mlayout.embeddings, *mlayout.per_expert_paths()])) | expert_names
    )
    cfg["target_parameters"] = suffixes(sorted(target_parameters), mlayout.experts, min_depth=3) or None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors, out_dir / WEIGHTS_NAME)
    write_json(out_dir / CONFIG_NAME, cfg)
    if provenance is not None:
        write_json(out_dir / PROVENANCE_NAME, provenance)
    return cfg


def _plan_ranks(adapter: CanonicalAdapter) -> tuple[int, float, dict[str, int], dict[str, int], dict[str, float]]:
    """-> (r, lora_alpha, each entry's written rank, rank_pattern, alpha_pattern), by entry name. One rank for every
    entry (_rerank: what engines that take one rank per adapter read) unless the adapter's entries carry their own
    scalings (the source had rank_pattern / alpha_pattern): then each keeps its inner dimension, named in
    rank_pattern where it differs from r and in alpha_pattern where r and lora_alpha would not give its scaling
    exactly. Refuses where no alpha gives exactly an entry's scaling."""
    names = [*adapter.dense, *adapter.experts, *adapter.embed]
    inner = {n: (adapter.dense.get(n) or adapter.experts.get(n) or adapter.embed[n])[0].shape[-2] for n in names}
    if not adapter.scalings:
        rank, alpha = _rerank(adapter)
        return rank, alpha, dict.fromkeys(names, rank), {}, {}
    ranks, alphas = {}, {}
    for n in names:
        r, s = inner[n], adapter.scaling_of(n)
        if r != adapter.rank:
            ranks[n] = r
        if peft_scaling(adapter.alpha, r, adapter.use_rslora) != s:
            alpha = s * (math.sqrt(r) if adapter.use_rslora else r)
            if peft_scaling(alpha, r, adapter.use_rslora) != s:
                raise InputError(
                    f"{n}: no lora_alpha gives exactly its scaling {s!r} at rank {r}; refusing to "
                    "approximate. Use the source adapter as it is."
                )
            alphas[n] = alpha
    return adapter.rank, adapter.alpha, inner, ranks, alphas


def _pattern(entries: dict, mlayout, layout: str) -> dict:
    """Entry name -> value as rank_pattern / alpha_pattern keys PEFT matches (a regex for a dotted suffix of the module
    path, parameter path for 3D experts): the path below the decoder root (so that a multimodal checkpoint's
    model.language_model root matches too), every expert's module through a regex over its index."""
    out = {}
    for name, v in sorted(entries.items()):
        key = name.removeprefix("model.")
        p = mlayout.experts.get(name)
        if p is None or layout == "peft3d":
            out[key] = v
        else:
            for part in p.disk_parts(layout):
                out[rf"{p.module.removeprefix('model.')}\.\d+\.{part}"] = v
    return out


def convert_command(model_ref: str, src: str | Path, to: str, disk_root: str | None = None) -> str:
    """The ``lpdiff adapters convert`` command line that rewrites ``src`` in layout ``to`` (under ``disk_root``): what
    a refusal names as its fix."""
    root = f" --disk-root {disk_root}" if disk_root else ""
    return f"lpdiff adapters convert --model {model_ref} {src} OUT --to {to}{root}"


def reroot_fix(info, model_ref: str, root: str, layouts: Sequence[str]) -> dict[str, str] | None:
    """For an adapter (``AdapterInfo``) with modules outside decoder root ``root``: ``where`` (the first of them)
    and ``to_root``, the command that writes it under the root in one of ``layouts`` (its own when listed); None
    when every module is under the root."""
    outside = info.outside_root(root)
    if not outside:
        return None
    to = info.layout if info.layout in layouts else layouts[0]
    return {"where": several(outside), "to_root": convert_command(model_ref, info.path, to, root)}


def convert_adapter(
    src_dir: str | Path, dst_dir: str | Path, to: str, model_config, disk_root: str | None = None
) -> AdapterSpec:
    """Convert between the expert layouts (LAYOUTS; dense entries are copied). Exact both ways:
    per_expert -> peft3d stays at rank r when gate and up share A in every expert, and otherwise stacks to rank 2r
    (block-structured B, alpha doubled so the scaling is identical); the rank change is recorded in
    lpdiff_adapter.json. Refuses (clear error) where exactness is impossible (rslora with a rank change)."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if src_dir.resolve() == dst_dir.resolve():
        raise InputError("convert_adapter writes a new directory; give a dst_dir other than src_dir")
    adapter = load_canonical(src_dir, model_config)
    prov = read_provenance(src_dir)
    cfg = save_canonical(adapter, dst_dir, model_config, to, disk_root)
    step = {
        "from": adapter.layout,
        "to": to,
        "rank": [adapter.rank, cfg["r"]],
        "alpha": [adapter.alpha, cfg["lora_alpha"]],
        "disk_root": disk_root or "model",
    }
    if cfg["r"] != adapter.rank:
        step["why"] = (
            "per-expert gate and up have different A matrices; fused exactly by stacking A and "
            "block-structured B, other entries zero-padded"
        )
    prov["conversions"] = [*prov.get("conversions", []), step]
    write_json(dst_dir / PROVENANCE_NAME, prov)
    return AdapterSpec(name=dst_dir.name, path=str(dst_dir))
