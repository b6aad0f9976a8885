"""Content-addressed store of reference runs (baselines) in a local directory.

A key hashes a canonical description of what was computed (model and adapter identity, prompts, dtype, TP, engine,
top-k). The value is the run's .npz plus a sidecar .json holding that description, the run's metadata and the
.npz's sha256. Layout: ``root/<digest[:2]>/<digest>.npz`` and ``.json``. Writes go to a temp file in the same
directory and are renamed into place under a per-key file lock (see path_lock), so pytest-xdist workers can share
one store.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from filelock import FileLock

from lpdiff.harness.types import AdapterSpec, LogprobRun, ModelSpec, canonical_hash, prompts_hash

FORMAT = 1
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class BaselineError(Exception):
    """Base of every store error; each message names the command that fixes it."""


class BaselineMissing(BaselineError):
    pass


class BaselineCorrupt(BaselineError):
    pass


class BaselineStale(BaselineError):
    pass


class BaselineExists(BaselineError):
    pass


def path_lock(path: str | Path) -> FileLock:
    """An inter-process lock for one file. It lives in the temp dir, not beside the file, so that reading
    committed baselines (or a read-only checkout) never leaves lock files behind. Guards processes of one host."""
    name = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    lock_dir = Path(tempfile.gettempdir()) / "lpdiff-locks"
    lock_dir.mkdir(exist_ok=True)
    return FileLock(str(lock_dir / f"{name}.lock"))


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(slots=True, frozen=True)
class BaselineKey:
    digest: str  # sha256 of description
    description: str  # canonical JSON of what was computed (identities, not names or paths)
    model_name: str  # names are for messages and stale detection; they are not part of the digest
    adapter_name: str | None = None

    @property
    def fields(self) -> dict[str, Any]:
        return json.loads(self.description)

    def label(self) -> str:
        f = self.fields
        adapter = f"adapter {self.adapter_name!r}" if self.adapter_name else "no adapter"
        return (f"model {self.model_name!r}, {adapter} (engine {f['engine']}, {f['dtype']}, tp={f['tp']}, "
                f"top_k={f['top_k']})")

    def regen_hint(self) -> str:
        f = self.fields
        cmd = f"lpdiff regen --model {self.model_name}"
        cmd += f" --adapter {self.adapter_name}" if self.adapter_name else ""
        cmd += f" --engine {f['engine']} --dtype {f['dtype']} --tp {f['tp']}"
        cmd += f" --top-k {f['top_k']}" if f["top_k"] else ""
        return f"regenerate it with `{cmd}` or run the suite with `pytest --lpdiff-regen`"


def baseline_key(model: ModelSpec, adapter: AdapterSpec | None, prompts: Sequence[Sequence[int]], dtype: str,
                 tp: int, engine: str, top_k: int = 0, extra: dict | None = None) -> BaselineKey:
    """Key of the reference run of ``engine`` on ``model`` (+ ``adapter``) over ``prompts``. ``extra`` holds
    anything else that changes the numbers (engine options, reference-engine version pins)."""
    content = {
        "model": model.identity(),
        "adapter": None if adapter is None else adapter.identity(),
        "prompts": prompts_hash(prompts),
        "dtype": dtype,
        "tp": int(tp),
        "engine": engine,
        "top_k": int(top_k),
        "extra": extra or {},
    }
    return BaselineKey(canonical_hash(content), _canonical(content), model.name,
                       None if adapter is None else adapter.name)


def _same_arrays(a: LogprobRun, b: LogprobRun) -> bool:
    xa, xb = a.to_arrays(), b.to_arrays()
    return xa.keys() == xb.keys() and all(np.array_equal(xa[k], xb[k], equal_nan=True) for k in xa)


def _lane(fields: dict[str, Any], names: dict[str, Any]) -> tuple:
    """What a human calls "the same baseline": names and run settings, but not the content identities."""
    return (names.get("model"), names.get("adapter"), fields.get("engine"), fields.get("dtype"), fields.get("tp"),
            fields.get("top_k"), _canonical(fields.get("extra")))


class BaselineStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _paths(self, key: BaselineKey) -> tuple[Path, Path]:
        assert _DIGEST.match(key.digest), f"not a sha256 digest: {key.digest!r}"
        d = self.root / key.digest[:2]
        return d / f"{key.digest}.npz", d / f"{key.digest}.json"

    def _locked(self, key: BaselineKey) -> FileLock:
        return path_lock(self._paths(key)[0])

    def put(self, key: BaselineKey, run: LogprobRun, overwrite: bool = False) -> bool:
        """Store ``run`` under ``key``. Returns False when an equal run (same arrays; metadata such as wall time
        may differ) is already there, e.g. another xdist worker won the race. A different stored run raises
        BaselineExists unless ``overwrite``."""
        self._check_run(key, run)
        npz, side = self._paths(key)
        npz.parent.mkdir(parents=True, exist_ok=True)
        with self._locked(key):
            if side.exists() and not overwrite:
                if _same_arrays(self._read(key), run):
                    return False
                raise BaselineExists(f"a different baseline is already stored for {key.label()} at {npz}; "
                                     f"refusing to overwrite it. If the reference really changed, "
                                     f"{key.regen_hint()}")
            fd, tmp = tempfile.mkstemp(dir=npz.parent, prefix=f".{key.digest}.", suffix=".npz")
            os.close(fd)
            tmp_side = tmp[:-len(".npz")] + ".json"
            try:
                run.save(tmp)
                blob = Path(tmp).read_bytes()
                info = {"format": FORMAT, "digest": key.digest, "key": key.fields,
                        "names": {"model": key.model_name, "adapter": key.adapter_name},
                        "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob), "meta": run.meta,
                        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
                Path(tmp_side).write_text(json.dumps(info, indent=1, sort_keys=True, default=str) + "\n")
                # the sidecar lands last: it is what marks the key as present
                os.replace(tmp, npz)
                os.replace(tmp_side, side)
            finally:
                for t in (tmp, tmp_side):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(t)
        return True

    def _check_run(self, key: BaselineKey, run: LogprobRun) -> None:
        f = key.fields
        if prompts_hash([p.token_ids for p in run.prompts]) != f["prompts"]:
            raise ValueError(f"the run is over other prompts than the key for {key.label()} was built from; "
                             "build the key from the same prompts the engine ran")
        widths = {None if p.topk_ids is None else p.topk_ids.shape[1] for p in run.prompts}
        if f["top_k"] and widths != {f["top_k"]}:
            raise ValueError(f"the key asks for top_k={f['top_k']} but the run's top-k widths are {widths}; "
                             f"run the engine with top_k={f['top_k']}")

    def get(self, key: BaselineKey) -> LogprobRun:
        """The stored run, checksum-verified. Raises BaselineMissing / BaselineStale / BaselineCorrupt."""
        _, side = self._paths(key)
        if not side.exists():
            stale = self.find_stale(key)
            if stale:
                raise BaselineStale(f"the baseline for {key.label()} was computed from something else: "
                                    f"{self._differences(key, stale[0])} changed; {key.regen_hint()}")
            raise BaselineMissing(f"no baseline for {key.label()} in {self.root} (key {key.digest[:12]}); "
                                  f"{key.regen_hint()}")
        with self._locked(key):
            return self._read(key)

    def _read(self, key: BaselineKey) -> LogprobRun:
        npz, side = self._paths(key)
        try:
            info = json.loads(side.read_text())
            stored, checksum = _canonical(info["key"]), info["sha256"]
        except (ValueError, KeyError, TypeError) as e:
            raise BaselineCorrupt(f"baseline sidecar {side} is unreadable ({e}); {key.regen_hint()}") from None
        if stored != key.description:
            raise BaselineStale(f"the baseline stored at {side} describes another computation than "
                                f"{key.label()} (hash collision or edited file): stored {stored}, wanted "
                                f"{key.description}; {key.regen_hint()}")
        try:
            blob = npz.read_bytes()
        except FileNotFoundError:
            raise BaselineCorrupt(f"baseline {npz} is missing next to its sidecar; {key.regen_hint()}") from None
        if hashlib.sha256(blob).hexdigest() != checksum:
            raise BaselineCorrupt(f"baseline {npz} fails its sha256 check (the file was damaged or edited); "
                                  f"{key.regen_hint()}")
        return LogprobRun.load(io.BytesIO(blob))

    def _sidecars(self) -> Iterator[dict[str, Any]]:
        for side in sorted(self.root.glob("??/*.json")):
            if not _DIGEST.match(side.stem):
                continue  # a temp file of a writer in progress
            with contextlib.suppress(ValueError, OSError):
                yield json.loads(side.read_text())

    def list(self) -> list[BaselineKey]:
        return [BaselineKey(i["digest"], _canonical(i["key"]), i["names"]["model"], i["names"]["adapter"])
                for i in self._sidecars() if {"digest", "key", "names"} <= i.keys()]

    def find_stale(self, key: BaselineKey) -> list[BaselineKey]:
        """Stored keys with the same names and settings as ``key`` but other content (the model, adapter or
        prompts changed under the same name): what ``lpdiff regen`` replaces."""
        want = _lane(key.fields, {"model": key.model_name, "adapter": key.adapter_name})
        return [k for k in self.list() if k.digest != key.digest
                and _lane(k.fields, {"model": k.model_name, "adapter": k.adapter_name}) == want]

    @staticmethod
    def _differences(key: BaselineKey, old: BaselineKey) -> str:
        new_f, old_f = key.fields, old.fields
        return ", ".join(f"{k} ({_canonical(old_f.get(k))} -> {_canonical(new_f.get(k))})"
                         for k in sorted(new_f) if new_f.get(k) != old_f.get(k))

    def delete(self, key: BaselineKey) -> bool:
        npz, side = self._paths(key)
        if not side.exists() and not npz.exists():
            return False
        with self._locked(key):
            for p in (side, npz):  # sidecar first: a reader then sees "missing", never a half-deleted value
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        return True
