"""The key of a baseline in the store (store.py): a sha256 over a canonical description of what was computed (model
and adapter identity, prompts, dtype, TP, engine, top-k, options), with the names that messages, the stale rule and
the regen hint use beside it (names are not part of the digest)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lpdiff.harness.types import AdapterSpec, ModelSpec, canonical_hash, prompts_hash


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(slots=True, frozen=True)
class BaselineKey:
    digest: str  # sha256 of description
    description: str  # canonical JSON of what was computed (identities, not names or paths)
    model_name: str  # names are for messages and the stale rule; they are not part of the digest
    adapter_name: str | None = None
    prompt_set: str | None = None  # the prompt set's name; None: prompts given as a list (their hash names them)
    # the command a caller knows regenerates it (a job's own flags: a checkpoint path, --prompts); not identity
    regen_command: str | None = field(default=None, compare=False)

    @property
    def fields(self) -> dict[str, Any]:
        return json.loads(self.description)

    def label(self) -> str:
        f = self.fields
        adapter = f"adapter {self.adapter_name!r}" if self.adapter_name else "no adapter"
        depth = f", {f['model']['num_layers']} layers" if f["model"].get("num_layers") is not None else ""
        prompts = f"prompt set {self.prompt_set!r}" if self.prompt_set else f"prompts {f['prompts'][:12]}"
        return (
            f"model {self.model_name!r}{depth}, {adapter}, {prompts} (engine {f['engine']}, {f['dtype']}, "
            f"tp={f['tp']}, top_k={f['top_k']})"
        )

    def regen_hint(self) -> str:
        if self.regen_command:
            return f"regenerate it with `{self.regen_command}` or run the suite with `pytest --lpdiff-regen`"
        f = self.fields
        cmd = f"lpdiff regen --model {self.model_name}"
        cmd += f" --adapter {self.adapter_name}" if self.adapter_name else ""
        cmd += f" --prompt-set {self.prompt_set}" if self.prompt_set not in (None, "default") else ""
        cmd += f" --num-layers {f['model']['num_layers']}" if f["model"].get("num_layers") is not None else ""
        # regen writes reference runs: the stored run's engine and dtype are regen's --reference / --ref-dtype
        cmd += f" --reference {f['engine']} --ref-dtype {f['dtype']}"
        cmd += f" --tp {f['tp']}" if f["tp"] != 1 else ""
        cmd += f" --top-k {f['top_k']}" if f["top_k"] else ""
        return f"regenerate it with `{cmd}` or run the suite with `pytest --lpdiff-regen`"

    def computation(self) -> tuple:
        """What a human calls "the same baseline": names, depth, prompt set and run settings, but not the content
        identities. Two keys with equal computations and other digests: the older one is stale (the model,
        adapter or prompt set changed under its name). Prompts given without a set name are named by their hash,
        so two such lists never make each other stale."""
        f = self.fields
        return (
            self.model_name,
            f["model"].get("num_layers"),
            self.adapter_name,
            self.prompt_set or f["prompts"],
            f["engine"],
            f["dtype"],
            f["tp"],
            f["top_k"],
            canonical_json(f.get("extra")),
        )


def baseline_key(
    model: ModelSpec,
    adapter: AdapterSpec | None,
    prompts: Sequence[Sequence[int]],
    dtype: str,
    tp: int,
    engine: str,
    top_k: int = 0,
    extra: dict | None = None,
    prompt_set: str | None = None,
    regen_command: str | None = None,
) -> BaselineKey:
    """Key of the reference run of ``engine`` on ``model`` (+ ``adapter``) over ``prompts`` (the prompt set
    ``prompt_set`` when they are one: a name, not hashed, that the stale rule and the regen hint use). ``extra``
    holds anything else that changes the numbers (engine options, reference-engine version pins)."""
    content = {
        "model": model.identity(),
        "adapter": None if adapter is None else adapter.identity(),
        "prompts": prompts_hash(prompts),
        "dtype": dtype,
        "tp": int(tp),
        "engine": engine,
        "top_k": int(top_k),
        "extra": extra or {},
    }
    return BaselineKey(
        canonical_hash(content),
        canonical_json(content),
        model.name,
        None if adapter is None else adapter.name,
        prompt_set,
        regen_command,
    )


def key_from_manifest(manifest: dict[str, Any]) -> BaselineKey:
    names = manifest["names"]
    return BaselineKey(
        manifest["digest"],
        canonical_json(manifest["key"]),
        names["model"],
        names.get("adapter"),
        names.get("prompt_set"),
    )
