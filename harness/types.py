"""The plain data that flows between stages: specs in, logprob runs out.

Everything an engine returns is a ``PromptLogprobs`` per prompt (numpy arrays, float32 logprobs whatever the
engine computed in); a ``LogprobRun`` bundles them with metadata so that a run can be stored and compared later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of one prompt. n tokens give n-1 positions: logprobs[i] = log p(token[i+1] | token[:i+1])."""

    token_ids: np.ndarray  # (n,) int64
    logprobs: np.ndarray  # (n-1,) float32
    topk_ids: np.ndarray | None = None  # (n-1, k) int64, best first
    topk_logprobs: np.ndarray | None = None  # (n-1, k) float32
    # Smallest top-k routing margin seen by position i over all MoE layers (engines that expose routing);
    # positions at or after a near-tie are flagged by the verdict instead of passing or failing silently.
    router_margin: np.ndarray | None = None  # (n,) float32
    # Per token and MoE layer (L = the model's MoE layers in decoder order, K = top-k), when the engine was asked to
    # capture routing: the chosen expert ids (int32; -1 where the engine reported none, e.g. a token no logprob
    # position sees), the top-k margin at that layer (the same score gap as router_margin) and the top-k weights.
    routed_experts: np.ndarray | None = None  # (n, L, K) int32
    routed_margins: np.ndarray | None = None  # (n, L) float32
    routed_weights: np.ndarray | None = None  # (n, L, K) float32

    def __post_init__(self):
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        n = self.token_ids.shape[0]
        assert self.token_ids.ndim == 1 and n >= 2, "a prompt needs at least two tokens"
        assert self.logprobs.shape == (n - 1,), f"logprobs {self.logprobs.shape} for {n} tokens"
        if self.topk_ids is not None:
            self.topk_ids = np.asarray(self.topk_ids, dtype=np.int64)
            self.topk_logprobs = np.asarray(self.topk_logprobs, dtype=np.float32)
            assert self.topk_ids.shape == self.topk_logprobs.shape and self.topk_ids.shape[0] == n - 1
        if self.router_margin is not None:
            self.router_margin = np.asarray(self.router_margin, dtype=np.float32)
            assert self.router_margin.shape == (n,)
        if self.routed_experts is not None:
            self.routed_experts = np.asarray(self.routed_experts, dtype=np.int32)
            assert self.routed_experts.ndim == 3 and self.routed_experts.shape[0] == n, (
                f"routed_experts {self.routed_experts.shape} for {n} tokens"
            )
        for name, dims in (("routed_margins", 2), ("routed_weights", 3)):
            v = getattr(self, name)
            if v is not None:
                v = np.asarray(v, dtype=np.float32)
                ids = self.routed_experts
                assert ids is not None and v.shape == ids.shape[:dims], (
                    f"{name} {v.shape} beside routed_experts {None if ids is None else ids.shape}"
                )
                setattr(self, name, v)


ROUTING_FIELDS = ("routed_experts", "routed_margins", "routed_weights")  # per token, stored like router_margin


@dataclass(slots=True)
class LogprobRun:
    """Logprobs for a prompt set plus what produced them (engine, version, dtype, TP, device, wall time...)."""

    prompts: list[PromptLogprobs]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(sum(p.token_ids.shape[0] for p in self.prompts))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flatten to named arrays (for .npz): per-prompt arrays are concatenated with an offsets vector."""
        out: dict[str, np.ndarray] = {}
        lens = np.array([p.token_ids.shape[0] for p in self.prompts], dtype=np.int64)
        out["lengths"] = lens
        out["token_ids"] = np.concatenate([p.token_ids for p in self.prompts])
        out["logprobs"] = np.concatenate([p.logprobs for p in self.prompts])
        for name in ("topk_ids", "topk_logprobs", "router_margin", *ROUTING_FIELDS):
            vals = [getattr(p, name) for p in self.prompts]
            if all(v is not None for v in vals):
                out[name] = np.concatenate(vals)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> LogprobRun:
        lens = arrays["lengths"]
        tok_off = np.concatenate([[0], np.cumsum(lens)])
        pos_off = np.concatenate([[0], np.cumsum(lens - 1)])
        prompts = []
        for i in range(len(lens)):
            t0, t1, p0, p1 = tok_off[i], tok_off[i + 1], pos_off[i], pos_off[i + 1]
            prompts.append(
                PromptLogprobs(
                    token_ids=arrays["token_ids"][t0:t1],
                    logprobs=arrays["logprobs"][p0:p1],
                    topk_ids=arrays["topk_ids"][p0:p1] if "topk_ids" in arrays else None,
                    topk_logprobs=arrays["topk_logprobs"][p0:p1] if "topk_logprobs" in arrays else None,
                    router_margin=arrays["router_margin"][t0:t1] if "router_margin" in arrays else None,
                    **{name: arrays[name][t0:t1] for name in ROUTING_FIELDS if name in arrays},
                )
            )
        return cls(prompts, dict(meta))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        arrays: dict[str, Any] = {
            "__meta__": np.frombuffer(json.dumps(self.meta, sort_keys=True).encode(), dtype=np.uint8),
            **self.to_arrays(),
        }
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path: str | Path | IO[bytes]) -> LogprobRun:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode()) if "__meta__" in z.files else {}
        return cls.from_arrays(arrays, meta)


def canonical_hash(obj: Any) -> str:
    """sha256 of a canonical JSON rendering (sorted keys, no whitespace): the basis of every content address."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def prompts_hash(prompts: Iterable[Iterable[int]]) -> str:
    """The identity of a prompt set (lists of ids, or numpy id arrays)."""
    return canonical_hash([list(map(int, p)) for p in prompts])


HASHED_SUFFIXES = (".json", ".safetensors", ".bin", ".txt")  # the files dir_hash reads


def dir_hash(path: str | Path, suffixes: tuple[str, ...] = HASHED_SUFFIXES) -> str:
    """Content hash of a checkpoint or adapter directory: file names (relative) and bytes, in sorted order."""
    path = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes):
        h.update(str(f.relative_to(path)).encode())
        h.update(b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """What model to run. Either a checkpoint directory in the Hub's layout (``path``), or a config from which the
    model is built with a seeded init recipe (``config`` + ``init_seed`` + ``init_recipe``: full-size suites build
    random models on the GPU instead of downloading them). ``num_layers`` reduces depth for either.

    ``source`` replaces the hash of ``path`` in the identity where hashing it every run would cost too much or say
    the wrong thing: ``{"hub": repo, "commit": sha}`` for a Hub snapshot, ``{"weights": hash}`` for a local
    directory (hash cached per file stat); with ``"num_layers": n`` when ``path`` is a copy already cut to n layers
    (then ``num_layers`` is None: engines must not cut it again)."""

    name: str
    arch: str  # transformers model_type: qwen3_moe, gpt_oss, qwen3_5_moe_text, nemotron_h, ...
    path: str | None = None
    config: dict | None = None
    init_seed: int | None = None
    init_recipe: str | None = None
    num_layers: int | None = None
    source: dict[str, Any] | None = None

    def __post_init__(self):
        assert (self.path is None) != (self.config is None), "give exactly one of path or config"
        assert self.source is None or self.path is not None, "source identifies a checkpoint directory"
        if self.config is not None:
            assert self.init_seed is not None and self.init_recipe, "a config-built model needs a seed and recipe"

    def identity(self) -> dict[str, Any]:
        """The canonical description hashed into baseline keys (content, never a local path)."""
        if self.path is not None:
            ident: dict[str, Any] = {"arch": self.arch, **(self.source or {"weights": dir_hash(self.path)})}
        else:
            ident = {
                "arch": self.arch,
                "config": canonical_hash(self.config),
                "seed": self.init_seed,
                "recipe": self.init_recipe,
            }
        if self.num_layers is not None:
            ident["num_layers"] = self.num_layers
        return ident


@dataclass(slots=True, frozen=True)
class AdapterSpec:
    """A PEFT-format adapter directory (adapter_config.json + adapter_model.safetensors) under a name."""

    name: str
    path: str

    def identity(self) -> dict[str, Any]:
        return {"adapter": dir_hash(self.path)}
