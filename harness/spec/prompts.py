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
from typing import Literal, overload

from lpdiff.harness.spec.errors import InputError, UnknownName

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

        zoo = Tokenizer.from_file(str(ZOO_TOKENIZER))
        return tuple(tuple(zoo.encode(d).ids) for d in _docs())
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tokenizer)
    return tuple(tuple(own.encode(d, add_special_tokens=False)) for d in _docs())


def _streams_for(tokenizer: str | Path | None) -> tuple[tuple[int, ...], ...]:
    """_streams of a checkpoint's tokenizer, or the zoo's when it is the zoo's (or None)."""
    return _streams(None if tokenizer is None or same_as_zoo(tokenizer) else str(Path(tokenizer).resolve()))


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


def _window(streams: tuple[tuple[int, ...], ...], i: int, start: int, n: int, name: str) -> list[int]:
    """``n`` tokens of held-out module ``i % len(streams)`` from ``start``, read on into the next modules where it
    is shorter (a larger vocabulary cuts the text into fewer tokens; long-prompt sets need several modules)."""
    ids = streams[i % len(streams)]
    for j in range(1, len(streams)):
        if start + n <= len(ids):
            break
        ids = ids + streams[(i + j) % len(streams)]
    if start + n > len(ids):
        raise InputError(
            f"the held-out text is too short for set {name!r}: {n} tokens from {start} of "
            f"{len(ids)} (harness/data/heldout.txt)"
        )
    return list(ids[start : start + n])


def named_prompts(name: str = "default", tokenizer: str | Path | None = None) -> list[list[int]]:
    """The prompts of set ``name``: windows of the held-out text cut with the zoo tokenizer (every id < 1024;
    resolve checks them against the model), or, given a model's own ``tokenizer`` directory that is not the zoo's,
    cut with that one: the zoo's ids would be other, meaningless text under it (flat predictions, near-ties).
    ``rl``: rl_prompts capped at RL_NAMED_MAX tokens."""
    if name == "rl":
        return rl_prompts(RL_NAMED_MAX, tokenizer=tokenizer)
    if name not in SETS:
        raise UnknownName(
            f"unknown prompt set {name!r}; known sets: "
            + ", ".join(f"{k} ({v.why})" for k, v in SETS.items())
            + f", rl ({RL_WHY})"
        )
    spec = SETS[name]
    streams = _streams_for(tokenizer)
    return [_window(streams, i, spec.start + (i // len(streams)) * n, n, name) for i, n in enumerate(spec.lengths)]


def prompt_set_names() -> list[str]:
    return list(SETS)


# -- RL-like long prompts (issue 42) ---------------------------------------------------------------------------------

# RL rollouts: thousands of tokens of prompt + response packed with short ones, crossing the engines' prefill steps
RL_LENGTHS = (16, 48, 300, 1000, 3000, 8192, 16384)
RL_NAMED_MAX = 1024  # the named set "rl": every zoo model's max_position_embeddings (and under every catalog one's)
RL_WHY = f"RL-like: chat-templated prompt + response and raw ids, {RL_LENGTHS[0]}-{RL_NAMED_MAX} tokens, packed"
RL_START = 1500  # token offset of the windows: other text than the short sets' (200-856)
# the plain template of a tokenizer without a chat template (the zoo's): the user turn, then the response
PLAIN_TEMPLATE = "<|user|>\n{prompt}\n<|assistant|>\n"
PROMPT_SHARE = 4  # a chat prompt's question is 1/4 of its tokens, the response the rest (RL: short prompt, long answer)


def past_step(step: int) -> int:
    """A prompt length that crosses a prefill step of ``step`` tokens: an eighth of a step past it, plus one, so
    its last chunk is ragged (not a multiple of any block size)."""
    return step + step // 8 + 1


def rl_lengths(max_len: int, step: int | None = None) -> list[int]:
    """The lengths of rl_prompts: RL_LENGTHS up to ``max_len``; when none of them exceeds ``step`` (the engine's
    prefill step, Capabilities.prefill_step_for), the longest becomes past_step(step). Ordered longest, shortest,
    second longest, ... so that short prompts sit between long ones in the packed batch."""
    lengths = [n for n in RL_LENGTHS if n <= max_len]
    if not lengths:
        raise InputError(f"max_len {max_len} is below the shortest RL prompt ({RL_LENGTHS[0]} tokens)")
    if step is not None and max(lengths) <= step:
        if past_step(step) > max_len:
            raise InputError(
                f"no prompt of at most {max_len} tokens (the model's or engine's max_model_len) crosses "
                f"a prefill step of {step} tokens: lower the engine's step (e.g. vLLM "
                f"max_num_batched_tokens, SGLang chunked_prefill_size, triton/hf max_batch_tokens) or "
                f"raise max_model_len"
            )
        lengths[-1] = past_step(step)
    ordered, lo, hi = [], 0, len(lengths) - 1
    while lo <= hi:
        ordered.append(lengths[hi])
        if lo < hi:
            ordered.append(lengths[lo])
        lo, hi = lo + 1, hi - 1
    return ordered


def _chat_tokenizer(tokenizer: str | Path | None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ZOO_TOKENIZER.parent if tokenizer is None else tokenizer))
    tok.model_max_length = 1 << 30  # the zoo's says 1024: long rollouts are the point here, not a mistake
    return tok


def template_ids(tok, prompt: str) -> list[int]:
    """The ids of a chat prompt before its response: the tokenizer's chat template (user turn, generation prompt)
    where it has one, else PLAIN_TEMPLATE tokenized without special tokens."""
    if getattr(tok, "chat_template", None):
        out = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tok.encode(PLAIN_TEMPLATE.format(prompt=prompt), add_special_tokens=False))


@overload
def rl_prompts(
    max_len: int, step: int | None = None, tokenizer: str | Path | None = None, kinds: Literal[False] = False
) -> list[list[int]]: ...
@overload
def rl_prompts(
    max_len: int, step: int | None = None, tokenizer: str | Path | None = None, *, kinds: Literal[True]
) -> tuple[list[list[int]], list[str]]: ...
def rl_prompts(
    max_len: int, step: int | None = None, tokenizer: str | Path | None = None, kinds: bool = False
) -> list[list[int]] | tuple[list[list[int]], list[str]]:
    """RL-like prompts of rl_lengths(max_len, step) tokens, each exactly that long: every other one (the longest
    first) a rollout as the trainer scores it — a chat-templated question (template_ids) followed by its response's
    ids, ending in the tokenizer's EOS — the others raw token ids (a window of held-out text), as RL stacks hand
    engines pre-tokenized ids. A chat prompt whose template leaves no room for a response (the shortest lengths under
    a long template) is raw ids. Text and ids come from the held-out modules cut with ``tokenizer`` (a checkpoint
    directory; None or the zoo's: the zoo tokenizer). ``kinds``: also return "chat" / "raw" per prompt."""
    lengths = rl_lengths(max_len, step)
    streams = _streams_for(tokenizer)
    tok = _chat_tokenizer(tokenizer)
    eos = tok.eos_token_id
    out, what = [], []
    for i, n in enumerate(lengths):
        window = _window(streams, i, RL_START, n, "rl")
        ids = None
        if i % 2 == 0:
            q = max(1, n // PROMPT_SHARE)
            while ids is None and q >= 1:
                head = template_ids(tok, tok.decode(window[:q]))
                room = n - len(head) - (eos is not None)
                if room >= 1:
                    ids = head + window[q : q + room] + ([eos] if eos is not None else [])
                q //= 2
        out.append(ids if ids is not None else window)
        what.append("chat" if ids is not None else "raw")
        assert len(out[-1]) == n, (n, len(out[-1]))
    return (out, what) if kinds else out
