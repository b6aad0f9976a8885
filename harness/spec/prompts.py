"""Named prompt sets: token-id prompts cut from committed held-out text (``harness/data/heldout.txt``, stdlib
modules the zoo never trained on) with the committed zoo tokenizer, so they are the same on every machine and
the tiny models' predictions on them are peaked.

Prompts are windows of each held-out module's token stream (the models trained on random windows too). Lengths
differ within a set on purpose: engines must handle ragged batches. Full-size catalog models get the same ids
(every id is < 1024, valid in any of their vocabularies); their random weights do not care what the ids mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass(slots=True, frozen=True)
class PromptSetSpec:
    lengths: tuple[int, ...]
    start: int  # token offset into each held-out module's stream
    why: str

    def __post_init__(self):
        assert all(n >= 2 for n in self.lengths) and self.start >= 0


SETS: dict[str, PromptSetSpec] = {
    "default": PromptSetSpec((24, 61, 37, 96, 48, 85, 30, 72), 200, "8 ragged prompts, 24-96 tokens"),
    "long": PromptSetSpec((256, 241, 256, 229), 600, "4 prompts of ~256 tokens (sliding windows, recurrences)"),
    "short": PromptSetSpec((8, 13, 19, 24), 100, "4 short prompts for slow paths (Triton interpreter)"),
    "bench": PromptSetSpec((512,) * 8, 0, "8 x 512 tokens for throughput"),
}


@lru_cache(maxsize=1)
def _streams() -> tuple[tuple[int, ...], ...]:
    """Each held-out module's token ids, in the committed file's order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA_DIR / "tokenizer" / "tokenizer.json"))
    text = (DATA_DIR / "heldout.txt").read_text(encoding="utf-8")
    docs = [chunk.partition(" ====\n")[2] for chunk in text.split("\n# ==== ")[1:]]
    assert docs, "harness/data/heldout.txt holds no modules"
    return tuple(tuple(tok.encode(d).ids) for d in docs)


def prompt_set(model_name: str, name: str = "default") -> list[list[int]]:
    """The prompts of set ``name`` for catalog model ``model_name`` (fresh lists; callers may mutate them)."""
    from lpdiff.harness.spec.catalog import get_model

    get_model(model_name)  # unknown model -> KeyError listing the known ones
    return named_prompts(name)


def named_prompts(name: str = "default") -> list[list[int]]:
    """The prompts of set ``name``, for any model (every id is < 1024; resolve checks them against the model)."""
    if name not in SETS:
        raise KeyError(f"unknown prompt set {name!r}; known sets: "
                       + ", ".join(f"{k} ({v.why})" for k, v in SETS.items()))
    spec, streams = SETS[name], _streams()
    out = []
    for i, n in enumerate(spec.lengths):
        ids = streams[i % len(streams)]
        start = spec.start + (i // len(streams)) * n
        assert start + n <= len(ids), f"held-out module {i % len(streams)} is too short for set {name!r}"
        out.append(list(ids[start:start + n]))
    return out


def prompt_set_names() -> list[str]:
    return list(SETS)
