"""Pass/fail thresholds per (model, engine pair, dtype, TP), each with where it came from.

A measured threshold is the noise floor between two correct runs (``lpdiff calibrate``) times a margin factor,
stamped with date, commit and GPU. Anything else is ``source="unmeasured"`` and says so in every verdict. Lookup
falls back exact -> same model, pair and dtype at another TP -> the dtype's default, and the result's ``match``
and ``note`` say which one was used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lpdiff.harness.pipeline.store import path_lock
from lpdiff.harness.spec.errors import InputError, UnknownName

DEFAULT_PATH = Path(__file__).with_name("thresholds.json")
SOURCES = ("measured", "unmeasured")
MATCHES = ("exact", "other-tp", "default")


@dataclass(slots=True)
class Threshold:
    k2: float
    max_abs: float
    delta_fidelity: float | None
    source: str  # "measured" (noise floor x margin) or "unmeasured" (a guess, said so)
    noise_k2: float | None = None
    noise_max_abs: float | None = None
    margin_factor: float | None = None
    date: str | None = None
    commit: str | None = None
    gpu: str | None = None
    note: str = ""
    # what it was looked up for, and how: filled by lookup()
    model: str = "*"
    engine_pair: str = "*"
    dtype: str = "*"
    tp: int | None = None
    match: str = "exact"

    def __post_init__(self):
        assert self.source in SOURCES, f"source must be one of {SOURCES}, got {self.source!r}"
        assert self.match in MATCHES, f"match must be one of {MATCHES}, got {self.match!r}"
        assert self.k2 > 0 and self.max_abs > 0, "thresholds must be positive"
        if self.source == "measured":
            assert self.noise_k2 is not None and self.noise_max_abs is not None and self.margin_factor, (
                "a measured threshold needs its noise floor and margin factor"
            )

    @property
    def provenance(self) -> str:
        """One short phrase for tables: measured/unmeasured, plus the fallback when one was used."""
        return self.source + ("" if self.match == "exact" else f" ({self.match})")


def pair_name(engine_pair: str | tuple[str, str]) -> str:
    """Canonical "<under test>-vs-<reference>" name, e.g. ("vllm", "hf") -> "vllm-vs-hf"."""
    if isinstance(engine_pair, str):
        assert "-vs-" in engine_pair, f"engine pair must look like 'vllm-vs-hf', got {engine_pair!r}"
        return engine_pair
    a, b = engine_pair
    return f"{a}-vs-{b}"


def from_noise(
    noise_k2: float,
    noise_max_abs: float,
    margin_factor: float,
    *,
    noise_delta_fidelity: float | None = None,
    gpu: str,
    commit: str,
    note: str = "",
) -> Threshold:
    """A measured threshold: the noise floor between two correct runs times ``margin_factor``."""
    return Threshold(
        k2=noise_k2 * margin_factor,
        max_abs=noise_max_abs * margin_factor,
        delta_fidelity=None if noise_delta_fidelity is None else noise_delta_fidelity * margin_factor,
        source="measured",
        noise_k2=noise_k2,
        noise_max_abs=noise_max_abs,
        margin_factor=margin_factor,
        date=datetime.date.today().isoformat(),
        commit=commit,
        gpu=gpu,
        note=note,
    )


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"threshold file {path} is unreadable ({e}); restore it from git") from None
    assert "defaults" in data and "entries" in data, f"{path} needs 'defaults' and 'entries'"
    return data


_ENTRY_KEYS = ("model", "engine_pair", "dtype", "tp")


def _threshold(entry: dict[str, Any], **looked_up: Any) -> Threshold:
    fields = {k: v for k, v in entry.items() if k not in _ENTRY_KEYS}
    return Threshold(**fields, **looked_up)


def lookup(
    model: str, engine_pair: str | tuple[str, str], dtype: str, tp: int, path: str | Path = DEFAULT_PATH
) -> Threshold:
    pair = pair_name(engine_pair)
    data = _load(Path(path))
    same = [e for e in data["entries"] if (e["model"], e["engine_pair"], e["dtype"]) == (model, pair, dtype)]
    looked_up = dict(model=model, engine_pair=pair, dtype=dtype, tp=tp)
    for e in same:
        if e["tp"] == tp:
            return _threshold(e, **looked_up)
    if same:
        e = min(same, key=lambda e: abs(e["tp"] - tp))  # the nearest TP shares most of the reduction order
        t = _threshold(e, **looked_up, match="other-tp")
        t.note = f"no entry for tp={tp}; using the tp={e['tp']} entry. " + t.note
        return t
    if dtype not in data["defaults"]:
        raise UnknownName(f"no threshold default for dtype {dtype!r} in {path}; known: {sorted(data['defaults'])}")
    t = _threshold(data["defaults"][dtype], **looked_up, match="default")
    t.note = f"no entry for {model} {pair} {dtype}; using the {dtype} default. " + t.note
    return t


def record(
    model: str,
    engine_pair: str | tuple[str, str],
    dtype: str,
    tp: int,
    threshold: Threshold,
    path: str | Path = DEFAULT_PATH,
) -> None:
    """Add or replace the entry for (model, engine pair, dtype, tp); atomic and safe against parallel writers."""
    path = Path(path)
    pair = pair_name(engine_pair)
    entry = {"model": model, "engine_pair": pair, "dtype": dtype, "tp": int(tp)}
    entry.update({k: v for k, v in dataclasses.asdict(threshold).items() if k not in _ENTRY_KEYS and k != "match"})
    with path_lock(path):
        data = _load(path)
        data["entries"] = [
            e
            for e in data["entries"]
            if (e["model"], e["engine_pair"], e["dtype"], e["tp"]) != (model, pair, dtype, tp)
        ]
        data["entries"].append(entry)
        data["entries"].sort(key=lambda e: tuple(e[k] for k in _ENTRY_KEYS))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
