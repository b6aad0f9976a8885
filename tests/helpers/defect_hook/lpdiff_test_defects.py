"""Engine defects the tests write themselves (not bug-zoo faults: kernels/faults.py knows nothing of them), each a
patch of the triton runtime that a correct harness must catch with its plain default run.

  tp_partial_twice     every rank but 0 hands its row-parallel partial (attention o and experts) to the all-reduce
                       twice over: the sum counts that shard's delta twice. Only under TP > 1 (TP 1 has no rank 1).
  shared_outer_misread the adapter loader reads the shared factor of a shared-outer adapter (one gate_up A for every
                       expert) with its rank rows reversed, so it no longer pairs with B. Only that layout: any other
                       adapter loads as before.
  per_expert_swapped   the adapter loader hands expert 0's LoRA B to expert 1 and expert 1's to expert 0 when the
                       file is in the per-expert layout (experts.{e}.gate_proj ...). Only that layout.
  tp_expert_lora_twice every rank but 0 holds layer 1's expert down-LoRA B doubled: its partial of that layer's
                       expert LoRA delta counts twice in the all-reduce. Only under TP > 1, only layer 1.
  last_slot_o_misread  with several adapters stacked, the last slot's layer-1 o_proj LoRA-B is read one row off (a
                       slot-offset copy). Only that adapter in a multi-adapter runtime; one adapter loads as before.

The triton engine's TP workers are separate interpreters started with ``spawn``, which in-process monkeypatching
cannot reach; they inherit the environment, so ``sitecustomize.py`` beside this file (its folder put on PYTHONPATH)
installs the defects named in $LPDIFF_TEST_DEFECTS in each of them at interpreter start. The test process itself
(rank 0) installs them with ``install(names, monkeypatch.setattr)``.
"""

from __future__ import annotations

import os

ENV = "LPDIFF_TEST_DEFECTS"
HOOK_DIR = os.path.dirname(os.path.abspath(__file__))


def _tp_partial_twice(setattr) -> None:
    import torch.distributed as dist

    from lpdiff.engines.triton import tp

    correct = tp.all_reduce_fn

    def all_reduce_fn(world: int):
        if world == 1:
            return correct(world)

        def all_reduce(x):
            if dist.get_rank() != 0:
                x.mul_(2)  # this shard's partial counted twice
            dist.all_reduce(x)
            return x

        return all_reduce

    setattr(tp, "all_reduce_fn", all_reduce_fn)


def is_shared_outer(adapter) -> bool:
    """Every expert's gate_up A is one matrix (the shared-outer layout's input-side factor)."""
    return any(
        k.endswith("gate_up_proj") and a.shape[0] > 1 and bool((a == a[:1]).all())
        for k, (a, _) in adapter.experts.items()
    )


def _shared_outer_misread(setattr) -> None:
    from lpdiff.engines.triton import runtime

    correct = runtime.load_canonical

    def load_canonical(path, hf):
        ad = correct(path, hf)
        if is_shared_outer(ad):
            ad.experts = {k: ((a.flip(-2) if k.endswith("gate_up_proj") else a), b) for k, (a, b) in ad.experts.items()}
        return ad

    setattr(runtime, "load_canonical", load_canonical)


def is_per_expert(adapter) -> bool:
    """Read from the per-expert layout (one module per expert on disk)."""
    return adapter.layout == "per_expert"


def _per_expert_swapped(setattr) -> None:
    from lpdiff.engines.triton import runtime

    correct = runtime.load_canonical

    def load_canonical(path, hf):
        ad = correct(path, hf)
        if is_per_expert(ad):
            ad.experts = {k: (a, b[[1, 0, *range(2, b.shape[0])]]) for k, (a, b) in ad.experts.items()}
        return ad

    setattr(runtime, "load_canonical", load_canonical)


def _tp_expert_lora_twice(setattr) -> None:
    from lpdiff.engines.triton import runtime

    correct = runtime.stack_adapters

    def stack_adapters(cfg, adapters, shard, dtype, device):
        lora = correct(cfg, adapters, shard, dtype, device)
        if shard.rank != 0 and lora is not None and lora.layers[1].moe is not None:
            lora.layers[1].moe.down_b.mul_(2)  # replicated B: this rank's partial delta doubles
        return lora

    setattr(runtime, "stack_adapters", stack_adapters)


def _last_slot_o_misread(setattr) -> None:
    from lpdiff.engines.triton import runtime

    correct = runtime.stack_adapters

    def stack_adapters(cfg, adapters, shard, dtype, device):
        key = "model.layers.1.self_attn.o_proj"
        last = list(adapters.values())[-1] if len(adapters) > 1 else None
        if last is not None and key in last.dense:
            a, b = last.dense[key]
            last.dense = {**last.dense, key: (a, b.roll(1, dims=0))}
        return correct(cfg, adapters, shard, dtype, device)

    setattr(runtime, "stack_adapters", stack_adapters)


DEFECTS = {
    "tp_partial_twice": _tp_partial_twice,
    "shared_outer_misread": _shared_outer_misread,
    "tp_expert_lora_twice": _tp_expert_lora_twice,
    "last_slot_o_misread": _last_slot_o_misread,
    "per_expert_swapped": _per_expert_swapped,
}


def install(names, setattr=setattr) -> None:
    for name in names:
        DEFECTS[name](setattr)


def env(names, base: dict | None = None) -> dict:
    """The environment variables that carry ``names`` into every process started with them (the TP workers)."""
    base = os.environ if base is None else base
    path = os.pathsep.join(p for p in (HOOK_DIR, base.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, ENV: ",".join(names)}
