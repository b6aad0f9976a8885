"""The model engines that start from a directory (vLLM, SGLang) load: a checkpoint directory, written once where
the spec has none or cuts layers, and whether its config is a MoE model."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from lpdiff.harness.types import canonical_hash


def checkpoint_dir(spec, root: str | Path | None = None, on_cpu: bool = True) -> str:
    """A checkpoint directory for engines that load only those (vLLM, SGLang): the spec's own when it has one and
    no layer cut; otherwise the model is built (catalog's seeded recipe, or the checkpoint cut to ``num_layers``)
    and written once under ``root`` (default ~/.cache/lpdiff/checkpoints), keyed by the spec's identity."""
    if spec.path is not None and spec.num_layers is None:
        return spec.path
    import torch

    from lpdiff.harness.spec.catalog import load_hf_model

    root = Path(root or Path.home() / ".cache" / "lpdiff" / "checkpoints")
    device = "cpu" if on_cpu else "cuda"
    # the seeded init draws different numbers on each device type: a config-built model is keyed by where it was
    # built (the HF reference builds it on the same device type, so both see the same weights)
    ident = spec.identity() if spec.path is not None else {**spec.identity(), "built_on": device}
    out = root / canonical_hash(ident)[:16]
    if (out / "config.json").is_file():
        return str(out)
    import time

    from lpdiff.engines.progress import progress_log

    log, t0 = progress_log(f"[checkpoint {spec.name}] "), time.perf_counter()
    dtype = torch.bfloat16 if spec.path is None else torch.float32  # config-built weights are bf16 by recipe
    model = load_hf_model(spec, dtype, device)
    log(f"built on {device} in {time.perf_counter() - t0:.1f}s")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    from lpdiff.harness.spec.checkpoint import write_checkpoint

    write_checkpoint(model, spec, tmp)  # the Hub repo's config.json, tensor names and shards
    if spec.path is not None:  # the tokenizer files travel with the cut checkpoint
        for f in Path(spec.path).iterdir():
            if f.is_file() and "token" in f.name:
                (tmp / f.name).write_bytes(f.read_bytes())
    log(f"written to {out} in {time.perf_counter() - t0:.1f}s")
    del model
    if not on_cpu:  # vLLM starts only if its share of the whole GPU is free: give back the build's cached blocks
        gc.collect()
        torch.cuda.empty_cache()
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first: theirs is the same model
        if not (out / "config.json").is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def is_moe_config(cfg) -> bool:
    from lpdiff.harness.spec.catalog import moe_fields

    try:
        return moe_fields(cfg).is_moe
    except NotImplementedError:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return any((getattr(text, k, 0) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))
