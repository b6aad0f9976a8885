"""Resolve what a command names — a model, its adapters, its prompts — once, into specs every later stage uses.

A model is a catalog name, a local checkpoint directory or a Hub repo ``ORG/NAME[@REV]``; an adapter is a zoo
name, a local PEFT directory or a Hub model/dataset repo ``[hf://datasets/]ORG/NAME[@REV][/SUBDIR]``; prompts are a
built-in set, a JSONL file or ``hf://datasets/ORG/NAME[@REV]`` (``PromptSource``). Everything that can be wrong
with them is found here, before any engine starts or anything is written, as one SpecError.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lpdiff.harness.spec import sources as src
from lpdiff.harness.spec.errors import SpecError
from lpdiff.harness.spec.prompt_sources import ModelText, PromptSource, check_prompt, load_prompts
from lpdiff.harness.types import AdapterSpec, ModelSpec

__all__ = ["Resolved", "SpecError", "resolve", "resolve_model", "zoo_adapters"]

ZOO_ADAPTERS = Path(__file__).resolve().parents[1] / "zoo_adapters"
ADAPTER_FILES = ["*.json", "*.safetensors"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def zoo_adapters(model: str) -> dict[str, AdapterSpec]:
    """The committed adapters of a tiny zoo model: harness/zoo_adapters/<model>/<adapter>/ (PEFT format)."""
    root = ZOO_ADAPTERS / model
    if Path(model).name != model or not root.is_dir():  # a path or Hub id is no zoo model
        return {}
    return {p.name: AdapterSpec(p.name, str(p)) for p in sorted(root.iterdir()) if (p / "adapter_config.json").exists()}


@dataclass(slots=True)
class Resolved:
    spec: ModelSpec
    adapters: dict[str, AdapterSpec]
    prompts: list[list[int]]
    user_adapters: tuple[str, ...] = field(default=())  # names of adapters not from the zoo (doctor checks them)

    def __iter__(self):  # spec, adapters, prompts = resolve(...)
        return iter((self.spec, self.adapters, self.prompts))


# -- models --------------------------------------------------------------------------------------------------------


def _model_type(path: Path, what: str) -> str:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"{what}: {path / 'config.json'} is unreadable ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise SpecError(f"{what}: {path / 'config.json'} has no model_type; not a transformers checkpoint")
    return str(config["model_type"])


def _need_weights(path: Path, what: str, fetch: str) -> None:
    if missing := src.missing_weights(path):
        raise SpecError(f"{what} has no weights {missing[:3]} in {path}; {fetch}")


def resolve_model(model: str, num_layers: int | None = None, weights: bool = True) -> ModelSpec:
    """A catalog name, checkpoint directory or Hub id -> ModelSpec. ``weights`` False: only config and tokenizer
    are needed (nothing else is downloaded, no content hash). ``num_layers`` on a real checkpoint with weights:
    the spec points at a copy cut to that depth (``cut``), read without the dropped layers."""
    from lpdiff.harness.spec.catalog import get_model, known_models

    if model in known_models():
        return get_model(model, num_layers=num_layers)
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")):
        path = src.checkpoint_dir(path, "--model", "config.json").resolve()
        arch = _model_type(path, f"--model {model}")
        if weights:
            _need_weights(path, f"--model {model}", "give a checkpoint directory with its *.safetensors")
        source = {"weights": src.cached_dir_hash(path)} if weights else None
        return _cut(ModelSpec(name=str(path), arch=arch, path=str(path), source=source), num_layers, weights)
    ref = src.parse_hub(model)
    if ref is None or ref.repo_type != "model":
        raise SpecError(
            f"unknown model {model!r}: not a catalog model ({', '.join(known_models())}), not a "
            "directory, not a Hub model id ORG/NAME[@REV]"
        )
    snap = src.snapshot(ref, src.CONFIG_FILES + (src.WEIGHT_FILES if weights else []))
    if not (snap.path / "config.json").is_file():
        raise SpecError(f"{ref.label} has no config.json at commit {snap.commit[:12]}: not a transformers model")
    if weights:
        _need_weights(snap.path, ref.label, f"fetch them with `{ref.fetch_command()}`")
    source = {"hub": ref.repo_id, "commit": snap.commit, **({"subfolder": ref.subfolder} if ref.subfolder else {})}
    spec = ModelSpec(name=model, arch=_model_type(snap.path, ref.label), path=str(snap.path), source=source)
    return _cut(spec, num_layers, weights)


def _cut(spec: ModelSpec, num_layers: int | None, weights: bool) -> ModelSpec:
    if num_layers is None:
        return spec
    if not weights:  # config readers cut the config themselves (catalog.hf_config)
        return ModelSpec(name=spec.name, arch=spec.arch, path=spec.path, source=spec.source, num_layers=num_layers)
    from lpdiff.harness.spec.cut import cut_checkpoint

    assert spec.path is not None and spec.source is not None  # a directory read with its weights has an identity
    out = cut_checkpoint(Path(spec.path), num_layers, spec.source, src.cache_root())
    return ModelSpec(name=spec.name, arch=spec.arch, path=str(out), source={**spec.source, "num_layers": num_layers})


def _config(spec: ModelSpec):
    from lpdiff.harness.spec.catalog import hf_config

    try:
        return hf_config(spec)
    except (ValueError, KeyError, OSError) as e:
        raise SpecError(f"model {spec.name}: transformers cannot read its config ({str(e).splitlines()[0]})") from None


# -- adapters ------------------------------------------------------------------------------------------------------


def _hub_adapter(ref: src.HubRef, text: str) -> tuple[Path, str]:
    """-> (adapter folder in the snapshot, its name: the subfolder's, else the repo's)."""
    try:
        snap = src.snapshot(ref, ADAPTER_FILES)
    except SpecError as first:
        if ref.typed:
            raise
        try:  # ORG/NAME without models/ or datasets/: SGLang keeps test adapters in dataset repos
            snap = src.snapshot(ref.other_kind(), ADAPTER_FILES)
        except SpecError:
            raise SpecError(f"{first} (tried the dataset repo {ref.repo_id} too)") from None
    name = Path(ref.subfolder).name or ref.repo_id.split("/")[1]
    if (snap.path / "adapter_config.json").is_file():
        return snap.path, name
    found = sorted({p.parent for p in snap.path.rglob("adapter_config.json")})
    if len(found) == 1:
        return found[0], found[0].name
    where = f"{snap.ref.label} (commit {snap.commit[:12]})"
    if not found:
        raise SpecError(f"--adapter {text}: {where} holds no adapter_config.json; not a PEFT adapter")
    subs = ", ".join(f"{snap.ref.repo_id}/{p.relative_to(snap.path)}" for p in found)
    raise SpecError(f"--adapter {text}: {where} holds several adapters; name one: {subs}")


def _adapter(text: str, model: str, zoo: dict[str, AdapterSpec]) -> tuple[AdapterSpec, bool]:
    """-> (spec named after its folder, is it from the zoo)."""
    if text in zoo:
        return zoo[text], True
    path = Path(text).expanduser()
    if path.exists() or text.startswith((".", "/", "~")):
        path = src.checkpoint_dir(path, "--adapter", "adapter_config.json").resolve()
        return AdapterSpec(path.name, str(path)), False
    ref = src.parse_hub(text)
    if ref is None:
        known = f"a zoo adapter of {model} ({', '.join(sorted(zoo))}), " if zoo else ""
        raise SpecError(
            f"model {model!r} has no adapter {text!r}: give {known}a PEFT adapter directory or a Hub "
            "repo [hf://datasets/]ORG/NAME[@REV][/SUBDIR]"
        )
    path, name = _hub_adapter(ref, text)
    return AdapterSpec(name, str(path)), False


def _adapters(model: str, asked: Sequence[str] | None) -> tuple[dict[str, AdapterSpec], tuple[str, ...]]:
    zoo = zoo_adapters(model)
    if asked is None:
        return zoo, ()
    out, user = {}, []
    for text in asked:
        a, from_zoo = _adapter(text, model, zoo)
        name, i = a.name, 2
        while name in out:  # two folders named alike: the second is name-2
            name, i = f"{a.name}-{i}", i + 1
        out[name] = AdapterSpec(name, a.path)
        if not from_zoo:
            user.append(name)
    return out, tuple(user)


# -- prompts -------------------------------------------------------------------------------------------------------


def _model_text(spec: ModelSpec, config) -> ModelText:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    has_tok = spec.path is not None and any((Path(spec.path) / f).is_file() for f in _TOKENIZER_FILES)
    return ModelText(
        spec.name, int(text.vocab_size), getattr(text, "max_position_embeddings", None), spec.path if has_tok else None
    )


def _prompts(prompts: str | PromptSource, spec: ModelSpec, config, catalog: bool) -> list[list[int]]:
    from lpdiff.harness.spec.prompts import named_prompts

    if isinstance(prompts, PromptSource):
        return load_prompts(prompts, _model_text(spec, config))
    mt = None if catalog else _model_text(spec, config)
    try:  # a model's own tokenizer cuts the built-in sets' text itself (the zoo's ids are other text under it)
        ids = named_prompts(prompts, mt.tokenizer_dir if mt else None)
    except KeyError as e:
        raise SpecError(str(e).strip("'\"")) from None
    if mt is not None:  # the catalog's vocabularies all hold the built-in sets' ids (< 1024)
        ids = [check_prompt(p, f"prompt set {prompts!r} prompt {i}", mt) for i, p in enumerate(ids)]
    return ids


def resolve(
    model: str,
    adapters: Sequence[str] | None = None,
    prompts: str | PromptSource = "default",
    num_layers: int | None = None,
    weights: bool = True,
) -> Resolved:
    """``adapters`` None = every committed adapter of a zoo model (none for other models). ``weights`` False:
    the model's config and tokenizer suffice (doctor, adapters convert, capability checks)."""
    from lpdiff.harness.spec.catalog import known_models
    from lpdiff.harness.spec.validate import check_adapters

    catalog = model in known_models()
    shallow = resolve_model(model, num_layers, weights=False)  # nothing cut or hashed until the rest is checked
    config = _config(shallow)
    chosen, user = _adapters(model, adapters)
    check_adapters(shallow, chosen)  # every adapter against the model, before anything runs or is written
    ids = _prompts(prompts, shallow, config, catalog)
    spec = shallow if catalog or not weights else resolve_model(model, num_layers, weights=True)
    if num_layers is not None and weights:  # every engine loads what the cut model has (adapters/depth.py)
        from lpdiff.harness.spec.adapters.depth import cut_adapter
        from lpdiff.harness.spec.sources import cache_root

        chosen = {n: cut_adapter(a, num_layers, cache_root()) for n, a in chosen.items()}
    return Resolved(spec, chosen, ids, user)
