"""Deliberately broken copies of a PEFT adapter: the faults an engine commits when it mishandles LoRA,
written as adapters so that any engine can be fed them and lpdiff must FAIL the result.

The expert mutations act on PEFT's stacked 3D expert tensors (``target_parameters``), where expert e's B is
``B.reshape(out, r, E)[:, :, e]`` (rank-major columns); ``drop_group`` acts on one module group (attention, linear
attention, mamba, shared expert, ...) in any layout. Everything else stays byte-identical.
tests/harness/spec/test_mutations.py and tests/harness/pipeline/test_hybrid_groups.py check each one against PEFT's
``merge_and_unload`` (only the intended weights move).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lpdiff.harness.spec.adapters import GROUPS, adapter_groups, module_group
from lpdiff.harness.spec.errors import InputError

WEIGHTS = "adapter_model.safetensors"


def _expert_b_keys(state: dict[str, torch.Tensor]) -> list[str]:
    keys = [k for k in state if ".experts." in k and k.endswith("lora_B.weight")]
    if not keys:
        raise InputError(
            "adapter has no stacked 3D expert LoRA (PEFT target_parameters); convert it with "
            "`lpdiff adapters convert --to peft3d` first"
        )
    return keys


def _mutate(src: str | Path, dst: str | Path, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Path:
    """Copy src to dst, then replace every expert lora_B (out, r*E) by fn(B viewed as (out, r, E), r)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    rank = int(json.loads((src / "adapter_config.json").read_text())["r"])
    state = load_file(dst / WEIGHTS)
    for k in _expert_b_keys(state):
        b = state[k]
        out, re = b.shape
        assert re % rank == 0, f"{k}: {re} columns is not rank {rank} x experts"
        state[k] = fn(b.reshape(out, rank, re // rank).clone(), rank).reshape(out, re).contiguous()
    save_file(state, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


def zero_expert(src, dst, expert: int = 0) -> Path:
    """Expert ``expert``'s LoRA silently dropped (as when an engine skips weights it cannot map)."""

    def fn(b, r):
        b[:, :, expert] = 0
        return b

    return _mutate(src, dst, fn)


def scale_experts(src, dst, factor: float = 2.0) -> Path:
    """Expert LoRA applied with the wrong scale (e.g. alpha/r computed from another rank)."""
    return _mutate(src, dst, lambda b, r: b * factor)


def permute_experts(src, dst, shift: int = 1) -> Path:
    """Expert e gets expert (e + shift)'s LoRA-B: a wrong expert ordering in the adapter loader."""
    return _mutate(src, dst, lambda b, r: torch.roll(b, shifts=shift, dims=2))


def drop_group(src, dst, group: str) -> Path:
    """Every LoRA of one module group silently dropped (LoRA-B zeroed), as an engine does when it skips the
    tensors of modules it has no LoRA path for (a shared expert, linear attention, a Mamba mixer). Keys and config
    stay as they are, so every engine loads the copy the way it loads the original."""
    if group not in GROUPS:
        raise InputError(f"drop_group: unknown group {group!r}; groups: {', '.join(GROUPS)}")
    src, dst = Path(src), Path(dst)
    present = adapter_groups(src)
    if group not in present:
        raise InputError(f"{src} has no {group} LoRA to drop; its groups: {', '.join(present) or 'none'}")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    state = load_file(dst / WEIGHTS)
    for k in state:
        if k.endswith(".lora_B.weight") and module_group(k.removesuffix(".lora_B.weight")) == group:
            state[k] = torch.zeros_like(state[k])
    save_file(state, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


MUTATIONS = {
    "zero_expert": zero_expert,
    "scale_experts": scale_experts,
    "permute_experts": permute_experts,
    "drop_group": drop_group,
}
