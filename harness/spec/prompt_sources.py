"""User prompts: a JSONL file (one prompt a line: ``{"token_ids": [...]}``, ``{"text": "..."}`` tokenized with the
model's own tokenizer, or ``{"messages": [...]}`` through its chat template) or a Hub dataset
``hf://datasets/ORG/NAME[@REV]`` read with ``datasets.load_dataset`` (split, column, count, seed). Every prompt is
checked against the model (vocabulary, at least two tokens, max_position_embeddings) and a bad one is one SpecError
naming its line or row."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lpdiff.harness.spec import validate
from lpdiff.harness.spec.errors import SpecError

KINDS = ("token_ids", "text", "messages")
_COLUMNS = ("token_ids", "input_ids", "messages", "text", "prompt", "question", "content")
DATA_FILES = [
    "*.parquet",
    "*.jsonl",
    "*.json",
    "*.csv",
    "*.txt",
    "*.arrow",
    "**/*.parquet",
    "**/*.jsonl",
    "**/*.json",
    "**/*.csv",
    "README.md",
]


@dataclass(slots=True, frozen=True)
class PromptSource:
    """``--prompts`` and its ``--prompts-*`` flags."""

    path: str  # FILE.jsonl or hf://datasets/ORG/NAME[@REV]
    split: str = "train"
    column: str | None = None  # default: the first of _COLUMNS the dataset has
    count: int | None = None  # default: every line / row
    seed: int | None = None  # shuffle the dataset with this seed before taking count rows

    def __post_init__(self):
        if self.count is not None and self.count < 1:
            raise SpecError(f"--prompts-count must be >= 1, got {self.count}")
        if not self.is_hub and not str(self.path).endswith(".jsonl"):
            raise SpecError(
                f"--prompts {self.path!r}: give a .jsonl file (one JSON object a line) or hf://datasets/ORG/NAME[@REV]"
            )

    @property
    def is_hub(self) -> bool:
        return str(self.path).startswith("hf://")

    def flags(self) -> str:
        """The command-line flags that name this source again."""
        out = f" --prompts {shlex.quote(str(self.path))}"  # a shell command line: paths may hold spaces
        out += f" --prompts-split {self.split}" if self.split != "train" else ""
        out += f" --prompts-column {self.column}" if self.column else ""
        out += f" --prompts-count {self.count}" if self.count else ""
        return out + (f" --prompts-seed {self.seed}" if self.seed is not None else "")


@dataclass(slots=True, frozen=True)
class ModelText:
    """What prompts are checked and tokenized against."""

    name: str
    vocab_size: int
    max_positions: int | None
    tokenizer_dir: str | None  # None: the model has no tokenizer files (config-built catalog models)


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise SpecError(f"--prompts {str(path)!r}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data[: e.start].count(b"\n") + 1
        raise SpecError(
            f"{path} line {lineno}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8"
        ) from None
    for i, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 inside a JSON string is no line end
        if not line.strip():
            continue
        try:
            yield f"{path} line {i}", json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} line {i}: not JSON ({e.msg})") from None


def _dataset(src: PromptSource) -> Iterator[tuple[str, Any]]:
    import datasets

    from lpdiff.harness.spec.sources import parse_hub, snapshot

    ref = parse_hub(src.path[len("hf://") :] if src.path.startswith("hf://datasets/") else "")
    if ref is None or ref.repo_type != "dataset":
        raise SpecError(f"--prompts {src.path!r}: expected hf://datasets/ORG/NAME[@REV]")
    snap = snapshot(ref, DATA_FILES)
    try:
        ds = datasets.load_dataset(str(snap.path), split=src.split)
    except ValueError as e:  # unknown split
        raise SpecError(f"{ref.label}: {str(e).splitlines()[0]} (--prompts-split)") from None
    column = src.column or next((c for c in _COLUMNS if c in ds.column_names), None)
    if column not in ds.column_names:
        raise SpecError(
            f"{ref.label} split {src.split!r} has no column {column!r}; columns: "
            f"{', '.join(ds.column_names)} (--prompts-column)"
        )
    if src.seed is not None:
        ds = ds.shuffle(seed=src.seed)
    if src.count is not None:
        ds = ds.select(range(min(src.count, len(ds))))
    for i, value in enumerate(ds[column]):
        kind = (
            "messages"
            if isinstance(value, list) and value and isinstance(value[0], dict)
            else "token_ids"
            if isinstance(value, list)
            else "text"
        )
        yield f"{ref.label} split {src.split!r} row {i}", {kind: value}


def _tokenizer(model: ModelText, where: str, kind: str):
    if model.tokenizer_dir is None:
        raise SpecError(
            f"{where}: {kind} prompts need the model's tokenizer and {model.name} has no tokenizer "
            "files; give token_ids"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.tokenizer_dir)


def _no_surrogates(text: str, where: str) -> None:
    bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:  # JSON's "\ud800" escape: a lone surrogate, which no tokenizer (nor UTF-8) can encode
        raise SpecError(
            f"{where}: text holds a lone surrogate (U+{ord(text[bad]):04X} at character {bad}), which "
            "is not a character; fix the \\u escape (a pair such as \\ud83d\\ude00 is one emoji)"
        )


def _ids(record: Any, where: str, model: ModelText, tok: list) -> list[int]:
    if not isinstance(record, dict) or sum(k in record for k in KINDS) != 1:
        raise SpecError(f"{where}: expected an object with exactly one of {', '.join(KINDS)}")
    kind = next(k for k in KINDS if k in record)
    value = record[kind]
    if kind == "token_ids":
        return value  # check_prompt refuses anything but a list of integers (floats are never rounded)
    if not tok:
        tok.append(_tokenizer(model, where, kind))
    if kind == "text":
        if not isinstance(value, str):
            raise SpecError(f"{where}: text must be a string")
        _no_surrogates(value, where)
        return list(tok[0](value)["input_ids"])
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise SpecError(f'{where}: messages must be a list of {{"role": ..., "content": ...}} objects')
    for text in (v for m in value for v in m.values() if isinstance(v, str)):
        _no_surrogates(text, where)
    if not getattr(tok[0], "chat_template", None):
        raise SpecError(f"{where}: {model.name}'s tokenizer has no chat template; give text or token_ids")
    out = tok[0].apply_chat_template(value, tokenize=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def check_prompt(ids: list[int], where: str, model: ModelText) -> list[int]:
    """``ids`` when the model can score them; ValidationError naming ``where`` and the problem otherwise."""
    return validate.check_prompt(ids, where, model.vocab_size, model.max_positions)


def load_prompts(src: PromptSource, model: ModelText) -> list[list[int]]:
    tok: list = []  # the tokenizer, loaded at the first text/messages prompt
    records = _dataset(src) if src.is_hub else _jsonl(Path(src.path))
    out = [check_prompt(_ids(rec, where, model, tok), where, model) for where, rec in records]
    if not src.is_hub and src.count is not None:
        out = out[: src.count]
    if not out:
        raise SpecError(f"--prompts {src.path}: no prompts")
    return out
