"""Deliberately broken copies of a PEFT adapter: the faults an engine commits when it mishandles expert LoRA,
written as adapters so that any engine can be fed them and lpdiff must FAIL the result.

All mutations act on PEFT's stacked 3D expert tensors (``target_parameters``), where expert e's B is
``B.reshape(out, r, E)[:, :, e]`` (rank-major columns), and leave everything else byte-identical.
tests/test_mutations.py checks each one against PEFT's ``merge_and_unload`` (only the intended experts move).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"


def _expert_b_keys(state: dict[str, torch.Tensor]) -> list[str]:
    keys = [k for k in state if ".experts." in k and k.endswith("lora_B.weight")]
    if not keys:
        raise ValueError("adapter has no stacked 3D expert LoRA (PEFT target_parameters); convert it with "
                         "`lpdiff adapters convert --to peft3d` first")
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


MUTATIONS = {"zero_expert": zero_expert, "scale_experts": scale_experts, "permute_experts": permute_experts}
