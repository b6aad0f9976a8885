"""A stand-in engine whose rows' last bits depend on how many rows share their forward, as MKL's sgemm and torch's
vectorised activations make them on CPU (the triton runtime's base rows moved by 9.5e-7 between an 8-row and a
56-row batch): the LoRA neutrality relation's choice of reference batch (relations._neutral,
Capabilities.mixed_batches) is a fact about batching, and a real engine shows it only on some CPUs, prompt counts
and step sizes. Here it shows everywhere, in milliseconds, with both batching schemes: one forward for the whole call
(the triton runtime, vLLM, SGLang) or one forward per adapter group (HF+PEFT), picked by the ``groups`` option.

A row's logprobs: a fixed function of its prompt, plus its adapter's offset (none for base rows), plus
``ROW_STEP`` times the rows of its forward. ``CALLS`` records every call (prompt indices' tokens, adapters) so a test
can read which batches ran. The module's ``CAPABILITIES`` says mixed_batches=True; a test replaces it to declare
otherwise."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from lpdiff.engines.base import EngineConfig, check_request
from lpdiff.engines.capabilities import Capabilities
from lpdiff.harness.types import PromptLogprobs

NAME = "rows"
ROW_STEP = 2.0**-20  # per row of the forward: 48 rows apart is 4.6e-5, far above an exact lane's bound of 0
CAPABILITIES = Capabilities(
    engine=NAME,
    label="row-count stand-in",
    versions="test",
    archs=None,
    layouts=("peft3d", "per_expert"),
    dtypes=("float32",),
    lora_fp32=True,
    max_rank=None,
    max_moe_rank=None,
    tp=(1,),
)
CALLS: list[tuple[list[tuple[int, ...]], list[str | None]]] = []


class RowCountEngine:
    name = NAME

    def __init__(self, config: EngineConfig):
        self.config = config
        self.groups = bool(config.options.get("groups", False))

    def __enter__(self) -> RowCountEngine:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def version(self) -> str:
        return "row-count stand-in, groups" if self.groups else "row-count stand-in, one forward per call"

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], adapter=None, top_k: int = 0) -> list[PromptLogprobs]:
        names = check_request(prompts, adapter, self.config.adapters, self.config.model)
        CALLS.append(([tuple(p) for p in prompts], list(names)))
        forwards = [[i for i, n in enumerate(names) if n == g] for g in dict.fromkeys(names)] if self.groups else None
        size = (
            {i: len(f) for f in forwards for i in f} if forwards else dict.fromkeys(range(len(prompts)), len(prompts))
        )
        return [self._row(p, n, size[i]) for i, (p, n) in enumerate(zip(prompts, names))]

    def _row(self, prompt: Sequence[int], adapter: str | None, rows: int) -> PromptLogprobs:
        ids = np.asarray(prompt, dtype=np.int64)
        lp = -1.0 - (ids[1:] % 97).astype(np.float32) / 50
        if adapter is not None:
            lp = lp - np.float32((zlib.crc32(adapter.encode()) % 1000) / 1e4)
        return PromptLogprobs(ids, (lp + np.float32(rows * ROW_STEP)).astype(np.float32))
