"""Named prompt sets: token-id prompts cut from committed held-out text (``harness/data/heldout.txt``, stdlib
modules the zoo never trained on) with the committed zoo tokenizer, so they are the same on every machine and
the tiny models' predictions on them are peaked.

Prompts are windows of each held-out module's token stream (the models trained on random windows too). Lengths
differ within a set on purpose: engines must handle ragged batches. Full-size catalog models get the same ids
(every id is < 1024, valid in any of their vocabularies); their random weights do not care what the ids mean. A
checkpoint with its own tokenizer gets the same windows of the same text cut with that tokenizer.
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


ZOO_TOKENIZER = DATA_DIR / "tokenizer" / "tokenizer.json"


def _docs() -> list[str]:
    text = (DATA_DIR / "heldout.txt").read_text(encoding="utf-8")
    docs = [chunk.partition(" ====\n")[2] for chunk in text.split("\n# ==== ")[1:]]
    assert docs, "harness/data/heldout.txt holds no modules"
    return docs


@lru_cache(maxsize=4)
def _streams(tokenizer: str | None = None) -> tuple[tuple[int, ...], ...]:
    """Each held-out module's token ids, in the committed file's order: with the zoo tokenizer (None), or with the
    tokenizer of the checkpoint directory ``tokenizer`` (no special tokens added)."""
    if tokenizer is None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ZOO_TOKENIZER))
        return tuple(tuple(tok.encode(d).ids) for d in _docs())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return tuple(tuple(tok.encode(d, add_special_tokens=False)) for d in _docs())


def same_as_zoo(tokenizer: str | Path | None) -> bool:
    """Whether a checkpoint directory's tokenizer is the zoo's (byte-identical tokenizer.json): the built-in sets'
    ids mean the same text there. None (no tokenizer: a config-built model) counts as the zoo's."""
    if tokenizer is None:
        return True
    own = Path(tokenizer) / "tokenizer.json"
    return own.is_file() and own.read_bytes() == ZOO_TOKENIZER.read_bytes()


def prompt_set(model_name: str, name: str = "default") -> list[list[int]]:
    """The prompts of set ``name`` for catalog model ``model_name`` (fresh lists; callers may mutate them)."""
    from lpdiff.harness.spec.catalog import get_model

    get_model(model_name)  # unknown model -> KeyError listing the known ones
    return named_prompts(name)


def named_prompts(name: str = "default", tokenizer: str | Path | None = None) -> list[list[int]]:
    """The prompts of set ``name``: windows of the held-out text cut with the zoo tokenizer (every id < 1024;
    resolve checks them against the model), or, given a model's own ``tokenizer`` directory that is not the zoo's,
    cut with that one: the zoo's ids would be other, meaningless text under it (flat predictions, near-ties)."""
    if name not in SETS:
        raise KeyError(f"unknown prompt set {name!r}; known sets: "
                       + ", ".join(f"{k} ({v.why})" for k, v in SETS.items()))
    spec = SETS[name]
    streams = _streams(None if same_as_zoo(tokenizer) else str(Path(tokenizer).resolve()))
    out = []
    for i, n in enumerate(spec.lengths):
        ids = streams[i % len(streams)]
        start = spec.start + (i // len(streams)) * n
        for j in range(1, len(streams)):  # a larger vocabulary cuts the text into fewer tokens: read on into the
            if start + n <= len(ids):  # next modules (the zoo tokenizer's streams are all long enough)
                break
            ids = ids + streams[(i + j) % len(streams)]
        assert start + n <= len(ids), f"the held-out text is too short for set {name!r}"
        out.append(list(ids[start:start + n]))
    return out


def prompt_set_names() -> list[str]:
    return list(SETS)
