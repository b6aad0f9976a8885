"""What ``lpdiff doctor`` reads before its engine checks: the adapter the user named (a directory, a zoo name or a
Hub repo, resolved as ``lpdiff run --adapter`` resolves it) and whether its tensors do anything at all."""

from __future__ import annotations

from pathlib import Path

from lpdiff.harness.pipeline.doctor_facts import Facts, Finding


def resolve_adapter(model, adapter: str | Path) -> str:
    """A directory as given; a zoo name or Hub repo resolved as ``lpdiff run --adapter`` does (spec/resolve.py)."""
    from lpdiff.harness.spec.resolve import _adapter, zoo_adapters

    if isinstance(adapter, Path) or Path(str(adapter)).expanduser().exists():
        return str(adapter)
    name = getattr(model, "name", None) or str(model)
    return _adapter(str(adapter), name, zoo_adapters(name))[0].path


def check_noop(f: Facts) -> list[Finding]:
    """Every lora_B zero (PEFT's default init saved untrained): every engine matches the reference on a no-op."""
    from safetensors import safe_open

    from lpdiff.harness.spec.adapters import WEIGHTS_NAME

    path = Path(f.info.path) / WEIGHTS_NAME
    if not path.is_file():  # the validation layer names a missing or pickled weights file
        return []
    with safe_open(str(path), framework="pt") as fh:
        keys = [k for k in fh.keys() if ".lora_B" in k]  # noqa: SIM118 - safe_open is not iterable
        if not keys or any(bool(fh.get_tensor(k).any()) for k in keys):
            return []
    return [
        Finding(
            "all",
            "error",
            "adapter-no-op",
            f"every lora_B tensor ({len(keys)}) is zero: the adapter is a "
            "no-op (PEFT's default init_lora_weights=True, saved untrained), so a run on it proves nothing",
            "train it, or create it with LoraConfig(init_lora_weights=False) (random B) or `lpdiff adapters "
            "gen --model MODEL --out DIR`",
        )
    ]
