"""The zoo's text: the training corpus (the running Python's top-level stdlib modules), the committed held-out
modules the prompt sets are cut from, and the byte-level BPE tokenizer trained on the corpus (recipe: zoo.py)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
TOKENIZER_DIR = DATA_DIR / "tokenizer"
HELDOUT = DATA_DIR / "heldout.txt"
VOCAB = 1024
EOS = "<|endoftext|>"
# Held out of training: their text is committed and the prompt sets are cut from it.
HELDOUT_MODULES = (
    "bisect.py",
    "colorsys.py",
    "fractions.py",
    "graphlib.py",
    "queue.py",
    "sched.py",
    "shlex.py",
    "textwrap.py",
)
# Not prose or code a model can learn from (generated tables, rot13, machine-specific data).
SKIPPED_MODULES = ("__hello__.py", "antigravity.py", "stringprep.py", "this.py")
DOC_SEPARATOR = "\n# ==== {name} ====\n"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def training_docs() -> list[str]:
    """The training corpus: every top-level stdlib module except the held-out and skipped ones."""
    out = []
    for f in sorted(stdlib_dir().glob("*.py")):
        if f.name in HELDOUT_MODULES or f.name in SKIPPED_MODULES or f.name.startswith("_sysconfigdata"):
            continue
        out.append(f.read_text(encoding="utf-8", errors="replace"))
    assert len(out) > 100, f"found only {len(out)} stdlib modules under {stdlib_dir()}"
    return out


def write_heldout() -> None:
    parts = [
        DOC_SEPARATOR.format(name=name) + (stdlib_dir() / name).read_text(encoding="utf-8") for name in HELDOUT_MODULES
    ]
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    HELDOUT.write_text("".join(parts), encoding="utf-8")


def heldout_docs() -> dict[str, str]:
    """Committed held-out text, by module name (never read from the running Python's stdlib)."""
    text = HELDOUT.read_text(encoding="utf-8")
    docs = {}
    for chunk in text.split("\n# ==== ")[1:]:
        name, _, body = chunk.partition(" ====\n")
        docs[name] = body
    return docs


def build_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(EOS) == 0
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tok.save(str(TOKENIZER_DIR / "tokenizer.json"))
    save_tokenizer(TOKENIZER_DIR)
    return load_tokenizer()


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def save_tokenizer(out: Path) -> None:
    """tokenizer.json plus the plain tokenizer_config.json that transformers 4 and 5 both load."""
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != TOKENIZER_DIR.resolve():
        shutil.copyfile(TOKENIZER_DIR / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": 1024,
            },
            indent=1,
        )
        + "\n"
    )


def token_stream(tok) -> torch.Tensor:
    """The training corpus as one int64 stream, modules separated by EOS."""
    ids: list[int] = []
    for doc in training_docs():
        ids.extend(tok(doc, verbose=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)
