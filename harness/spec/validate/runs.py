"""Logprob runs checked before they are judged or stored: files that are runs, finite logprobs <= 0, top-k ids in
the vocabulary, and two runs of the same prompts (and, unless asked otherwise, of the same model and adapter)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from lpdiff.harness.spec.validate.errors import ValidationError
from lpdiff.harness.types import LogprobRun

# A log-probability is <= 0; a log-softmax in fp32/bf16 can round a certain token's to a little above 0.
LOGPROB_TOL = 1e-3
RUN_ARRAYS = ("lengths", "token_ids", "logprobs")
_SAVED = "give a run saved by `lpdiff run --save-runs DIR`"
ZOO_DIR = Path(__file__).resolve().parents[2] / "zoo"  # spec.catalog's ZOO_DIR


def load_run(path: str | Path, arg: str = "--runs") -> LogprobRun:
    """A run saved by ``LogprobRun.save``; anything else is a ValidationError naming the file (never unpickled)."""
    p = Path(path)
    if not p.is_file():
        raise ValidationError(f"{arg} {p}: no such file; {_SAVED}")
    with open(p, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":  # not a zip: numpy would take it for a pickle
            raise ValidationError(f"{arg} {p}: not an .npz file; {_SAVED}")
    try:
        with np.load(p, allow_pickle=False) as z:
            missing = [k for k in RUN_ARRAYS if k not in z.files]
            if missing:
                raise ValidationError(
                    f"{arg} {p}: no {', '.join(repr(k) for k in missing)} array(s), so not a logprob run; {_SAVED}"
                )
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode()) if "__meta__" in z.files else {}
        return LogprobRun.from_arrays(arrays, meta)
    except ValidationError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, UnicodeDecodeError) as e:
        why = "holds pickled objects, which lpdiff never loads" if "pickle" in str(e) else "a damaged .npz file"
        raise ValidationError(f"{arg} {p}: {why}; {_SAVED}") from None
    except (AssertionError, IndexError):
        raise ValidationError(f"{arg} {p}: its arrays disagree in length (a damaged run); {_SAVED}") from None


def run_vocab(meta: dict) -> int | None:
    """The vocabulary size of the model a run names: its meta's vocab_size, else the catalog model's."""
    if isinstance(meta.get("vocab_size"), int):
        return meta["vocab_size"]
    zoo = ZOO_DIR / str(meta.get("model")) / "config.json"
    if zoo.is_file() and "/" not in str(meta.get("model")):  # the committed zoo, without importing the catalog (torch)
        cfg = json.loads(zoo.read_text())
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if isinstance(vocab, int):
            return vocab
    try:
        from lpdiff.harness.spec.catalog import get_model
        from lpdiff.harness.spec.validate.prompts import model_limits

        return model_limits(get_model(str(meta.get("model"))))[0]
    except (KeyError, OSError, ValueError):
        return None  # a model lpdiff does not know: ids are checked against 0 only


def _first(mask_per_prompt: list[np.ndarray]) -> tuple[int, int, int]:
    """(count, prompt, position) of the first True."""
    n = sum(int(m.sum()) for m in mask_per_prompt)
    for i, m in enumerate(mask_per_prompt):
        if m.any():
            return n, i, int(np.argwhere(m)[0][0])
    return 0, -1, -1


def check_run(
    run: LogprobRun,
    source: str,
    vocab_size: int | None = None,
    fix: str = "regenerate it (the engine or adapter that wrote it produced these values)",
) -> None:
    """Finite logprobs <= LOGPROB_TOL, top-k values finite and <= LOGPROB_TOL, top-k and token ids in the vocabulary."""
    checks = [
        ("logprob(s) are NaN or Inf", [~np.isfinite(p.logprobs) for p in run.prompts]),
        (
            f"logprob(s) are above 0 (+{LOGPROB_TOL})",
            [np.isfinite(p.logprobs) & (p.logprobs > LOGPROB_TOL) for p in run.prompts],
        ),
    ]
    topk = [(p.topk_ids, p.topk_logprobs) for p in run.prompts]
    if all(ids is not None and lps is not None for ids, lps in topk):
        ids_lps = [(ids, lps) for ids, lps in topk if ids is not None and lps is not None]
        checks += [
            ("top-k logprob(s) are NaN or Inf", [~np.isfinite(lps) for _, lps in ids_lps]),
            (
                f"top-k logprob(s) are above 0 (+{LOGPROB_TOL})",
                [np.isfinite(lps) & (lps > LOGPROB_TOL) for _, lps in ids_lps],
            ),
        ]
        hi = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
        where = f"[0, {vocab_size})" if vocab_size is not None else "the non-negative ids"
        checks.append((f"top-k id(s) are outside {where}", [(ids < 0) | (ids >= hi) for ids, _ in ids_lps]))
    for what, masks in checks:
        n, i, j = _first(masks)
        if n:
            raise ValidationError(f"{source}: {n} {what} (first: prompt {i}, position {j}); {fix}")


# The actual token's logprob and the same token's top-k entry come from one log-softmax in every engine lpdiff
# reads (they agree exactly in the committed baselines); 0.05 leaves room for an engine computing them apart in bf16.
TOPK_AGREE_TOL = 0.05


def check_topk_consistency(run: LogprobRun, source: str, fix: str) -> None:
    """Top-k data that can be true: per position distinct ids, logprobs sorted from the most likely down, the
    actual next token's logprob equal to its top-k entry when listed there and no higher than the k-th when not."""
    if any(p.topk_ids is None or p.topk_logprobs is None for p in run.prompts):
        return
    masks: dict[str, list[np.ndarray]] = {
        "top-k logprob rows are not sorted from the most likely down": [],
        "top-k rows list one token id twice": [],
        "actual-token logprobs disagree with their top-k entry": [],
        "actual-token logprobs are above the k-th top-k logprob of a top-k row that does not list the token": [],
    }
    lists = list(masks.values())
    for p in run.prompts:
        ids, lps = p.topk_ids, p.topk_logprobs
        assert ids is not None and lps is not None  # every prompt has both: checked above
        if ids.shape != lps.shape or ids.shape[0] != len(p.logprobs):
            raise ValidationError(
                f"{source}: top-k arrays of shape {ids.shape} / {lps.shape} for {len(p.logprobs)} positions; {fix}"
            )
        k = ids.shape[1]
        if k == 0:
            return
        lists[0].append(np.any(np.diff(lps, axis=1) > LOGPROB_TOL, axis=1))
        srt = np.sort(ids, axis=1)
        lists[1].append((srt[:, 1:] == srt[:, :-1]).any(axis=1))
        hit = ids == np.asarray(p.token_ids[1:])[:, None]
        listed = hit.any(axis=1)
        at = np.where(listed, lps[np.arange(len(ids)), hit.argmax(axis=1)], 0.0)
        lists[2].append(listed & ~(np.abs(at - p.logprobs) <= TOPK_AGREE_TOL))
        lists[3].append(~listed & (p.logprobs > lps[:, -1] + TOPK_AGREE_TOL))
    for what, mask in masks.items():
        n, i, j = _first(mask)
        if n:
            raise ValidationError(f"{source}: {n} {what} (first: prompt {i}, position {j}); {fix}")


def check_run_pair(a: LogprobRun, b: LogprobRun, names: tuple[str, str], allow_different: bool = False) -> None:
    """Two runs that can be compared position by position: the same prompts, and unless ``allow_different`` the same
    model and adapter according to their metadata."""
    same = len(a.prompts) == len(b.prompts) and all(
        np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a.prompts, b.prompts)
    )
    if not same:
        raise ValidationError(
            f"--runs: {names[0]} ({len(a.prompts)} prompts) and {names[1]} ({len(b.prompts)} "
            "prompts) score different prompts; compare runs of the same prompt set"
        )
    if allow_different:
        return
    for key in ("model", "adapter"):
        if a.meta.get(key) != b.meta.get(key):
            raise ValidationError(
                f"--runs: {names[0]} has {key} {a.meta.get(key) or '-'!s} but {names[1]} has "
                f"{b.meta.get(key) or '-'!s}; compare runs of the same {key}, or pass "
                "--allow-different to compare them anyway"
            )


def load_run_pair(
    path_a: str | Path, path_b: str | Path, allow_different: bool = False
) -> tuple[LogprobRun, LogprobRun]:
    """``lpdiff compare --runs A B``: both loaded and checked, alone and as a pair."""
    a, b = load_run(path_a), load_run(path_b)
    for p, r in ((path_a, a), (path_b, b)):
        check_run(r, f"--runs {p}", run_vocab(r.meta))
    check_run_pair(a, b, names=(str(path_a), str(path_b)), allow_different=allow_different)
    return a, b


def check_reference_runs(runs: dict, source: str) -> None:
    """Reference runs about to be stored (adapter name or None -> run): a non-finite one is refused, nothing
    stored."""
    for adapter, run in runs.items():
        check_run(
            run,
            f"{source} ({adapter or 'base'} run)",
            run_vocab(run.meta),
            fix="nothing was stored; check the adapter (lpdiff doctor MODEL ADAPTER) and the engine",
        )
