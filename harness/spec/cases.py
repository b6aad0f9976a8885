"""Trainer test cases: an adapter plus the logprobs a trainer computed for it, read as they are published.

A case is a directory or a Hub dataset repo (``hf://datasets/ORG/NAME[@REV]``, fetched with
``huggingface_hub.snapshot_download(repo_type="dataset")``, served from the HF cache when ``HF_HUB_OFFLINE=1``)
holding a PEFT adapter (adapter_config.json at the root or in one subfolder) and one reference file:

* ``compare_sample_train_data.pt`` — SGLang's / miles' layout (SGLang test/registered/lora/
  test_lora_*_logprob_diff.py): a dict with ``tokens`` (one prompt: a list of ids or a 1-D tensor; several: a list
  of lists or a 2-D tensor), ``training_logprobs`` (the trainer's, positions 1..n-1 of each prompt:
  log p(tokens[i] | tokens[:i]) for i >= 1, flat or per prompt) and ``sampling_logprobs`` (the original sampler's,
  same positions). Read with ``torch.load(weights_only=True)``: tensors, lists, numbers and strings only — lpdiff
  never unpickles objects.
* ``reference.jsonl`` or ``reference.parquet`` — the same for any trainer (Megatron, FSDP, verl, miles): one row
  per prompt with ``tokens`` (n ids), ``logprobs`` (n-1 trainer logprobs, positions 1..n-1) and optionally
  ``sampler_logprobs`` (n-1).

An optional ``case.json`` gives ``base_model`` (catalog name, directory or Hub id), ``kl_threshold`` and
``trainer``. Without a threshold, the one of SGLang's test for that base model applies (docs/cases.md).
"""

from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lpdiff.harness.spec.errors import InputError

PT_NAME = "compare_sample_train_data.pt"
TABLE_NAMES = ("reference.jsonl", "reference.parquet")

# kl_v2 thresholds of SGLang's trainer-reference tests, by base model (a substring of the model id, lower case).
SGLANG_THRESHOLDS = {"qwen3.5-35b-a3b": 1e-3, "nemotron-3-super-120b-a12b": 2.5e-3}
DEFAULT_THRESHOLD = 5e-3  # gpt-oss-20b, Qwen3-30B-A3B-Instruct-2507 and the other SGLang cases

_HF = re.compile(r"^hf://datasets/(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<rev>[^\s]+))?$")


class CaseError(InputError):
    """A case that cannot be read as published; the message names the file and the fix."""


@dataclass(slots=True)
class TrainerCase:
    """One case: prompts, the trainer's logprobs per prompt (n-1 each), the sampler's if given, the adapter."""

    source: str
    root: Path
    adapter_dir: Path
    prompts: list[list[int]]
    training: list[np.ndarray]
    sampling: list[np.ndarray] | None
    base_model: str | None = None
    threshold: float = DEFAULT_THRESHOLD
    info: dict = field(default_factory=dict)


def threshold_for(model: str | None) -> float:
    low = (model or "").lower()
    return next((t for k, t in SGLANG_THRESHOLDS.items() if k in low), DEFAULT_THRESHOLD)


def fetch(source: str) -> Path:
    """A case directory: ``source`` itself, or the Hub dataset snapshot it names."""
    m = _HF.match(source)
    if m is None:
        if source.startswith("hf://"):
            raise CaseError(f"case {source!r}: a Hub case is hf://datasets/ORG/NAME[@REV]")
        root = Path(source)
        if not root.is_dir():
            raise CaseError(f"case {source!r} is not a directory (or hf://datasets/ORG/NAME[@REV])")
        return root
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:  # offline, a commit-hash revision is only looked up in the cache when asked to (huggingface_hub 1.x)
        return Path(
            snapshot_download(
                m["repo"], repo_type="dataset", revision=m["rev"], local_files_only=constants.HF_HUB_OFFLINE
            )
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as e:
        raise CaseError(
            f"case {source!r} cannot be fetched ({type(e).__name__}); online, run "
            f"`hf download --repo-type dataset {m['repo']}"
            f"{' --revision ' + m['rev'] if m['rev'] else ''}` once"
        ) from None


def _adapter_dir(root: Path) -> Path:
    found = sorted({p.parent for p in root.rglob("adapter_config.json")}, key=lambda p: len(p.parts))
    if not found:
        raise CaseError(f"case {root}: no adapter_config.json (a PEFT adapter) at its root or in a subfolder")
    if len(found) > 1 and len(found[0].parts) == len(found[1].parts):
        raise CaseError(f"case {root}: several adapters ({', '.join(str(p) for p in found)}); keep one per case")
    return found[0]


def _as_list(x, what: str, path: Path) -> list:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if not isinstance(x, list) or not x:
        raise CaseError(f"{path}: {what} must be a non-empty list or tensor, got {type(x).__name__}")
    return x


def _per_prompt(values, lengths: list[int], what: str, path: Path) -> list[np.ndarray]:
    """n-1 values per prompt, given either flat (concatenated) or as one list per prompt."""
    values = _as_list(values, what, path)
    if isinstance(values[0], list):
        arrs = [np.asarray(v, dtype=np.float64) for v in values]
    else:
        flat = np.asarray(values, dtype=np.float64)
        cuts = np.cumsum([n - 1 for n in lengths])[:-1]
        if flat.shape[0] != sum(n - 1 for n in lengths):
            raise CaseError(
                f"{path}: {what} has {flat.shape[0]} values; positions 1..n-1 of the tokens need "
                f"{sum(n - 1 for n in lengths)}"
            )
        arrs = np.split(flat, cuts)
    bad = [i for i, (a, n) in enumerate(zip(arrs, lengths)) if a.shape != (n - 1,)]
    if len(arrs) != len(lengths) or bad:
        raise CaseError(
            f"{path}: {what} must give n-1 logprobs (positions 1..n-1) for each of the "
            f"{len(lengths)} prompts; prompt(s) {bad or 'count'} do not"
        )
    return arrs


def _prompts(tokens, path: Path) -> list[list[int]]:
    tokens = _as_list(tokens, "tokens", path)
    prompts = tokens if isinstance(tokens[0], list) else [tokens]
    if any(len(p) < 2 or not all(isinstance(t, int) for t in p) for p in prompts):
        raise CaseError(f"{path}: tokens must be integer ids, at least two per prompt")
    return [list(p) for p in prompts]


def _load_pt(path: Path) -> dict:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CaseError(
            f"{path} holds pickled Python objects that torch.load(weights_only=True) refuses "
            f"({str(e).splitlines()[0][:160]}); lpdiff never unpickles files. Re-save it with plain "
            "tensors and lists: torch.save({k: torch.as_tensor(v) for k, v in data.items()}, path)"
        ) from None
    except (RuntimeError, EOFError) as e:
        raise CaseError(f"{path} is not a readable torch file: {e}") from None
    if not isinstance(data, dict) or not {"tokens", "training_logprobs"} <= set(data):
        raise CaseError(
            f"{path}: expected a dict with tokens, training_logprobs[, sampling_logprobs]; got "
            f"{sorted(data) if isinstance(data, dict) else type(data).__name__}"
        )
    return data


def _load_table(path: Path) -> dict:
    if path.suffix == ".jsonl":
        lines = _text(path).splitlines()
        rows = []
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise CaseError(
                        f"{path}: line {i} is not JSON; write one JSON object per line (docs/cases.md)"
                    ) from None
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise CaseError(
                f"{path} is not a readable parquet file ({' '.join(str(e).split())[:160]}); "
                "re-export it (docs/cases.md)"
            ) from None
    if not rows or any(not isinstance(r, dict) or "tokens" not in r or "logprobs" not in r for r in rows):
        raise CaseError(f"{path}: every row needs tokens and logprobs (docs/cases.md)")
    sampler = [r.get("sampler_logprobs") for r in rows]
    return {
        "tokens": [r["tokens"] for r in rows],
        "training_logprobs": [r["logprobs"] for r in rows],
        "sampling_logprobs": sampler if all(s is not None for s in sampler) else None,
    }


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CaseError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None


def _case_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        info = json.loads(_text(path))
    except json.JSONDecodeError as e:
        raise CaseError(
            f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix it or remove "
            "it (case.json is optional: base_model, kl_threshold, trainer)"
        ) from None
    if not isinstance(info, dict):
        raise CaseError(
            f"{path} must hold a JSON object (base_model, kl_threshold, trainer), got {type(info).__name__}"
        )
    if info.get("base_model") is not None and not isinstance(info["base_model"], str):
        raise CaseError(f"{path}: base_model must be a string (catalog name, directory or Hub id)")
    return info


def _threshold(info: dict, path: Path) -> float:
    """A KL threshold: a finite number > 0 (inf or NaN would pass any engine, 0 or less none)."""
    value = info["kl_threshold"]
    try:
        t = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        t = float("nan")
    if not math.isfinite(t) or t <= 0:
        raise CaseError(
            f"{path}: kl_threshold must be a finite number > 0, got {value!r}; write e.g. "
            f'"kl_threshold": {DEFAULT_THRESHOLD}, or leave it out for the default of the base model'
        )
    return t


def load_case(source: str) -> TrainerCase:
    """Read a case (see the module docstring); every problem is one CaseError naming the file."""
    root = fetch(source)
    pt = root / PT_NAME
    tables = [root / n for n in TABLE_NAMES if (root / n).is_file()]
    if pt.is_file():
        path, data = pt, _load_pt(pt)
    elif tables:
        path, data = tables[0], _load_table(tables[0])
    else:
        raise CaseError(f"case {source}: no {PT_NAME} or {' / '.join(TABLE_NAMES)} in {root}")
    prompts = _prompts(data["tokens"], path)
    lengths = [len(p) for p in prompts]
    training = _per_prompt(data["training_logprobs"], lengths, "training_logprobs", path)
    sampling = data.get("sampling_logprobs")
    sampling = None if sampling is None else _per_prompt(sampling, lengths, "sampling_logprobs", path)
    info = _case_json(root / "case.json")
    base = info.get("base_model")
    threshold = _threshold(info, root / "case.json") if "kl_threshold" in info else threshold_for(base or source)
    return TrainerCase(source, root, _adapter_dir(root), prompts, training, sampling, base, threshold, info)


def check_vocab(case: TrainerCase, vocab_size: int) -> None:
    bad = sorted({t for p in case.prompts for t in p if not 0 <= t < vocab_size})
    if bad:
        raise CaseError(
            f"case {case.source}: token ids {bad[:5]}{' ...' if len(bad) > 5 else ''} are outside the "
            f"model's vocabulary (size {vocab_size}); the case was made for another model — pass its "
            "base model with --model"
        )
