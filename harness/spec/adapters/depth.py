"""An adapter for a depth-cut model (``--num-layers N``): the adapter's entries of layers 0..N-1, byte for byte, and
nothing of the layers the cut removed. Loaders check every entry against the model (the per-expert conversion, the
canonical form triton reads) and rightly refuse a module the model does not have, so a cut model needs a cut
adapter; the kept entries being the adapter's own, a cut run judges exactly the layers it runs."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from lpdiff.harness.spec.adapters.files import CONFIG_NAME, WEIGHTS_NAME, load_tensors, save_tensors
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import AdapterSpec

_LAYER = re.compile(r"\.layers\.(\d+)\.")  # every decoder's entries: model.layers.i, backbone.layers.i, ...


def deeper_entries(adapter_dir: str | Path, depth: int) -> list[str]:
    """Tensor names of layers >= ``depth`` (read from the safetensors header alone)."""
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / WEIGHTS_NAME), framework="pt") as f:
        # safe_open's handle has keys() but no __iter__, so SIM118's `k in f` would raise
        return [k for k in f.keys() if (m := _LAYER.search(k)) is not None and int(m[1]) >= depth]  # noqa: SIM118


def write_cut(adapter_dir: str | Path, out: str | Path, depth: int) -> Path:
    """A copy of ``adapter_dir`` at ``out`` without the entries of layers >= ``depth`` (its other files as they
    are); written beside ``out`` and renamed into place, so a reader never sees half a copy."""
    src, out = Path(adapter_dir), Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and p.name != WEIGHTS_NAME:
            shutil.copyfile(p, tmp / p.name)
    if not (tmp / CONFIG_NAME).is_file():
        raise InputError(f"{src} has no {CONFIG_NAME}: not a PEFT adapter directory")
    keep = {k: t for k, t in load_tensors(src).items() if (m := _LAYER.search(k)) is None or int(m[1]) < depth}
    save_tensors(keep, tmp / WEIGHTS_NAME)
    try:
        tmp.rename(out)
    except OSError:  # another process made the same copy first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / WEIGHTS_NAME).is_file():
            raise
    return out


def cut_adapter(spec: AdapterSpec, depth: int, cache: Path) -> AdapterSpec:
    """``spec`` itself when it has nothing beyond ``depth``, else its cut copy under ``cache`` (named by the
    adapter's content hash and the depth, so a regen and a run share one copy and one baseline key)."""
    if not deeper_entries(spec.path, depth):
        return spec
    out = cache / "adapters-cut" / f"{spec.identity()['adapter'][:24]}-layers{depth}"
    if not (out / WEIGHTS_NAME).is_file():
        write_cut(spec.path, out, depth)
    return AdapterSpec(spec.name, str(out))
