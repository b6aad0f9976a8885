"""Convert a store of format 1 (``<digest>.npz`` + ``<digest>.json`` sidecar) to parquet baselines, keeping keys.

``python -m lpdiff.harness.pipeline.store_legacy STORE`` writes each old baseline as a
parquet file under the same digest (checksum verified first), then removes the old pair; run it again after a
kill and it carries on. The prompt-set name (not recorded in format 1) is filled in where the prompts are a
catalog model's named set, so the stale rule groups them with new baselines of that set.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

from lpdiff.harness.pipeline.store import BaselineStore
from lpdiff.harness.pipeline.store_errors import BaselineCorrupt, BaselineError
from lpdiff.harness.pipeline.store_key import BaselineKey, canonical_json
from lpdiff.harness.types import LogprobRun


def read_pair(side: Path) -> tuple[BaselineKey, LogprobRun]:
    """(key, run, sidecar) of a format-1 baseline; BaselineCorrupt naming the file otherwise. Never unpickles."""
    npz = side.with_suffix(".npz")
    try:
        info = json.loads(side.read_text())
        blob = npz.read_bytes()
        if hashlib.sha256(blob).hexdigest() != info["sha256"]:
            raise ValueError(f"{npz.name} fails the sidecar's sha256")
        try:
            run = LogprobRun.load(io.BytesIO(blob))
        except (
            ValueError,
            OSError,
            KeyError,
            EOFError,
            zipfile.BadZipFile,
        ) as e:  # numpy's text would advise allow_pickle: never
            raise ValueError(f"{npz.name} is not an lpdiff .npz run") from e
        names = info["names"]
        key = BaselineKey(info["digest"], canonical_json(info["key"]), names["model"], names.get("adapter"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BaselineCorrupt(
            f"old-format baseline {side} is unreadable ({type(e).__name__}: {str(e)[:200]}); "
            "regenerate it with `lpdiff regen`"
        ) from None
    return key, run


def named_prompt_set(key: BaselineKey) -> str | None:
    """The catalog prompt set of ``key``'s model whose hash matches the key's prompts, if any."""
    from lpdiff.harness.spec.prompts import prompt_set, prompt_set_names
    from lpdiff.harness.types import prompts_hash

    for name in prompt_set_names():
        try:
            if prompts_hash(prompt_set(key.model_name, name)) == key.fields["prompts"]:
                return name
        except (KeyError, AssertionError):
            return None
    return None


def migrate(root: str | Path, log=print) -> list[str]:
    """Convert every format-1 baseline under ``root``; returns the digests converted."""
    store, done = BaselineStore(root), []
    for side in sorted(Path(root).glob("??/*.json")):
        if len(side.stem) != 64:
            continue
        key, run = read_pair(side)
        key = BaselineKey(key.digest, key.description, key.model_name, key.adapter_name, named_prompt_set(key))
        store.put(key, run, overwrite=True)
        store.get(key)  # read back (checksum) before the old pair goes
        side.unlink()
        side.with_suffix(".npz").unlink(missing_ok=True)
        log(f"converted {key.digest[:12]}  {key.label()}")
        done.append(key.digest)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lpdiff.harness.pipeline.store_legacy", description=__doc__)
    ap.add_argument("store", help="the store folder (what --baselines names)")
    args = ap.parse_args(argv)
    try:
        print(f"{len(migrate(args.store))} baseline(s) converted")
    except BaselineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
