"""Prompts checked once, the same way for every engine and command: a non-empty list of prompts, each of at least
two integer token ids inside the vocabulary and within the model's positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lpdiff.harness.spec.validate.errors import ValidationError

_LIMITS: dict[tuple, tuple[int | None, int | None]] = {}


def model_limits(spec) -> tuple[int | None, int | None]:
    """(vocabulary size, max_position_embeddings) of a ModelSpec, from its transformers config (None: unknown)."""
    key = (spec.name, spec.path, spec.num_layers, repr(spec.config))
    if key not in _LIMITS:
        from lpdiff.harness.spec.catalog import hf_config

        cfg = hf_config(spec)
        vocab, positions = getattr(cfg, "vocab_size", None), getattr(cfg, "max_position_embeddings", None)
        _LIMITS[key] = (int(vocab) if vocab else None, int(positions) if positions else None)
    return _LIMITS[key]


def _ids(p: Any, where: str) -> np.ndarray:
    """One prompt as int64 ids; floats are refused, never rounded."""
    if hasattr(p, "detach"):  # a torch tensor
        p = p.detach().cpu().numpy()
    # one pass over the element types (a bool is exactly type bool: it has no subclasses): 0.126 -> 0.045 ms per
    # 8 x 512 ids on the dev CPU against isinstance per element, on every engine's path to its first launch
    if isinstance(p, (list, tuple)):
        types = set(map(type, p))
        if bool in types:
            raise ValidationError(f"{where} holds booleans, not integer token ids; give integers")
        if types == {int}:  # plain ints: fromiter, 9 us against asarray's 24 per 512 ids on the dev CPU
            try:
                return np.fromiter(p, dtype=np.int64, count=len(p))
            except OverflowError:
                pass  # ids beyond int64: asarray's object array below, and the vocabulary check names them
    if isinstance(p, (str, bytes, dict)) or not hasattr(p, "__len__"):
        raise ValidationError(
            f"{where} is a {type(p).__name__}, not a list of token ids; give each prompt as a list of integers"
        )
    try:
        a = np.asarray(p)
    except (ValueError, TypeError):
        raise ValidationError(
            f"{where} is not a flat list of token ids; give each prompt as a list of integers"
        ) from None
    if a.ndim != 1:
        raise ValidationError(
            f"{where} has shape {a.shape}, not a flat list of token ids; give each prompt as a list of integers"
        )
    if a.size == 0 or a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "O" and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in a):
        return a  # ints beyond int64: the vocabulary check names them
    bad = next(x for x in a.tolist() if not isinstance(x, int) or isinstance(x, bool))
    raise ValidationError(
        f"{where} holds {type(bad).__name__} values (e.g. {bad!r}), not integer token "
        "ids; give integers (lpdiff never rounds or truncates ids)"
    )


def check_prompt(
    p: Any,
    where: str,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    truncate: bool = False,
    hint: str = "",
) -> list[int]:
    """One prompt -> its ids as ints, or ValidationError naming ``where`` (e.g. "--prompts f.jsonl line 3") and the
    fix. Longer than ``max_positions``: refused, or cut to it when ``truncate`` (the user asked for it); ``hint``
    says how the user asks for that."""
    return _as_ints(check_prompt_array(p, where, vocab_size, max_positions, truncate, hint))


def _as_ints(ids: np.ndarray) -> list[int]:
    return [int(x) for x in ids] if ids.dtype.kind == "O" else ids.tolist()


def check_prompt_array(
    p: Any,
    where: str,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    truncate: bool = False,
    hint: str = "",
) -> np.ndarray:
    """check_prompt's checks -> the ids as a (n,) int64 array (object dtype only for ids beyond int64, possible
    only without a vocabulary), for an engine that packs them into one array anyway: the triton runtime's checks
    and packing of 8 x 512 ids took 0.31 + 0.14 ms as int lists, 0.24 + 0.004 ms as arrays (the H200 machine's
    CPU, benchmarks/results/e2e.md)."""
    ids = _ids(p, where)
    if len(ids) < 2:
        raise ValidationError(
            f"{where} has {len(ids)} token(s); logprobs need at least 2 (one to condition on, one "
            "to score): drop it or make it longer"
        )
    if ids.dtype.kind == "O":  # ints beyond int64: compared one by one
        bad = [int(x) for x in ids if x < 0 or (vocab_size is not None and x >= vocab_size)]
    else:  # vectorised: a per-element Python loop cost ~3 ms per 8 x 512-token call, inside every engine's call
        out_of_range = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
        bad = ids[out_of_range].tolist()
    if bad:
        span = f"[0, {vocab_size})" if vocab_size is not None else "the non-negative ids"
        raise ValidationError(
            f"{where} has {len(bad)} token id(s) outside the vocabulary {span} (e.g. {bad[0]}); use "
            "ids of this model's tokenizer"
        )
    if max_positions is not None and len(ids) > max_positions:
        if not truncate:
            raise ValidationError(
                f"{where} has {len(ids)} tokens, more than the model's max_position_embeddings "
                f"({max_positions}); shorten it" + (f" or pass {hint}" if hint else "")
            )
        ids = ids[:max_positions]
    return ids


def check_prompts(
    prompts: Sequence[Sequence[int]],
    vocab_size: int | None = None,
    max_positions: int | None = None,
    truncate: bool = False,
    source: str = "prompts",
    hint: str = "",
) -> list[list[int]]:
    """A non-empty list of prompts, each through ``check_prompt`` (named "``source``: prompt i")."""
    return [_as_ints(ids) for ids in check_prompt_arrays(prompts, vocab_size, max_positions, truncate, source, hint)]


def check_prompt_arrays(
    prompts: Sequence[Sequence[int]],
    vocab_size: int | None = None,
    max_positions: int | None = None,
    truncate: bool = False,
    source: str = "prompts",
    hint: str = "",
) -> list[np.ndarray]:
    """check_prompts' checks -> each prompt's ids as check_prompt_array gives them."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValidationError(
            f"{source}: expected a list of prompts (lists of token ids), got a {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValidationError(f"{source}: no prompts; give at least one prompt of 2 or more token ids")
    return [
        check_prompt_array(p, f"{source}: prompt {i}", vocab_size, max_positions, truncate, hint)
        for i, p in enumerate(prompts)
    ]
