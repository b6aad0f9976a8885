"""--model / --adapter as local directories and Hub ids, resolved through the real huggingface_hub code against an HF
cache laid out as huggingface_hub writes it (HF_HUB_OFFLINE=1: no Hub is reachable from the tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lpdiff.harness.spec import sources
from lpdiff.harness.spec.catalog import ZOO_DIR, get_model
from lpdiff.harness.spec.resolve import SpecError, resolve, resolve_model
from tests.helpers.hf_cache import offline_home, populate
from tests.helpers.paths import REPO

MODEL = "tiny-qwen3-moe"
ZOO_ADAPTER = REPO / "harness" / "zoo_adapters" / MODEL / "all"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    return offline_home(monkeypatch, tmp_path)


def test_parse_hub_forms():
    assert sources.parse_hub("acme/m") == sources.HubRef("acme/m")
    assert sources.parse_hub("acme/m@v1.2") == sources.HubRef("acme/m", "v1.2")
    r = sources.parse_hub("hf://datasets/acme/case@abc/lora/a")
    assert (r.repo_id, r.revision, r.repo_type, r.subfolder, r.typed) == ("acme/case", "abc", "dataset", "lora/a", True)
    assert sources.parse_hub("not a repo") is None and sources.parse_hub("tiny") is None
    assert r.fetch_command() == "hf download acme/case --repo-type dataset --revision abc"


def test_local_dir_keys_like_the_zoo_and_hash_is_cached(hub, tmp_path, monkeypatch):
    d = tmp_path / "mymodel"
    shutil.copytree(ZOO_DIR / MODEL, d)
    spec = resolve_model(str(d))
    assert spec.path == str(d) and spec.arch == "qwen3_moe"
    assert spec.identity() == get_model(MODEL).identity()  # a copy of a zoo model finds the zoo's baselines

    def boom(*a, **k):
        raise AssertionError("content hash recomputed although no file changed")

    monkeypatch.setattr(sources, "dir_hash", boom)
    assert resolve_model(str(d)).identity() == spec.identity()
    (d / "generation_config.json").write_text("{}")  # a changed file: hashed again
    with pytest.raises(AssertionError, match="recomputed"):
        resolve_model(str(d))


def test_hub_model_offline_from_cache(hub, tmp_path):
    snap, commit = populate(hub, "acme/tiny-moe", ZOO_DIR / MODEL)
    populate(hub, "acme/tiny-moe", ZOO_DIR / MODEL, branch="v1", commit="1" * 40)
    spec = resolve_model("acme/tiny-moe")
    assert spec.path == str(snap) and spec.identity() == {"arch": "qwen3_moe", "hub": "acme/tiny-moe", "commit": commit}
    assert resolve_model(f"acme/tiny-moe@{commit}").identity() == spec.identity()
    assert resolve_model("acme/tiny-moe@v1").identity()["commit"] == "1" * 40
    # transformers reads the snapshot as it reads any checkpoint
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(spec.path).model_type == "qwen3_moe"
    assert AutoTokenizer.from_pretrained(spec.path)("def f(x):")["input_ids"]


@pytest.mark.parametrize(
    "ref, says",
    [("acme/nope", "hf download acme/nope"), ("acme/tiny-moe@v9", "hf download acme/tiny-moe --revision v9")],
)
def test_missing_repo_or_revision_is_one_error_with_the_fetch_command(hub, ref, says):
    populate(hub, "acme/tiny-moe", ZOO_DIR / MODEL)
    with pytest.raises(SpecError, match="HF_HUB_OFFLINE") as e:
        resolve_model(ref)
    assert says in str(e.value) and ref in str(e.value)


def test_config_only_cache_serves_weightless_commands(hub, tmp_path):
    """Only config/tokenizer files cached (what a weights=False resolve downloads): doctor-style callers work, a run
    is refused naming the fetch command."""
    populate(hub, "acme/cfg", ZOO_DIR / MODEL, skip=(".safetensors",))
    assert resolve_model("acme/cfg", weights=False).arch == "qwen3_moe"
    with pytest.raises(SpecError, match=r"lacks model.safetensors.*hf download acme/cfg"):
        resolve_model("acme/cfg")
    # no tree listing (a cache copied by hand): lpdiff still finds the weights missing
    populate(hub, "acme/cfg2", ZOO_DIR / MODEL, skip=(".safetensors",), listing=False)
    with pytest.raises(SpecError, match=r"no weights.*hf download acme/cfg2"):
        resolve_model("acme/cfg2")


def test_bad_directories(hub, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"has no config.json"):
        resolve(str(tmp_path / "empty"))
    with pytest.raises(SpecError, match=r"has no adapter_config.json"):
        resolve(MODEL, [str(tmp_path / "empty")])
    with pytest.raises(SpecError, match="unknown model"):
        resolve("no such thing")


def test_adapters_from_dirs_and_hub_repos(hub, tmp_path):
    populate(hub, "acme/lora-case", ZOO_ADAPTER, repo_type="dataset")  # SGLang keeps adapters in dataset repos
    multi = tmp_path / "multi"
    for sub in ("a", "b"):
        shutil.copytree(ZOO_ADAPTER, multi / sub)
    populate(hub, "acme/two", multi)
    d = tmp_path / "mine"
    shutil.copytree(ZOO_ADAPTER, d)
    r = resolve(MODEL, [str(d), "acme/lora-case", "hf://datasets/acme/lora-case", "acme/two/b", "attention"])
    assert list(r.adapters) == ["mine", "lora-case", "lora-case-2", "b", "attention"]
    assert r.user_adapters == ("mine", "lora-case", "lora-case-2", "b")
    assert json.loads((Path(r.adapters["b"].path) / "adapter_config.json").read_text())["r"] > 0
    assert r.adapters["lora-case"].identity() == r.adapters["mine"].identity()  # same bytes, same key
    with pytest.raises(SpecError, match="several adapters; name one: acme/two/a, acme/two/b"):
        resolve(MODEL, ["acme/two"])
    with pytest.raises(SpecError, match="tried the dataset repo"):
        resolve(MODEL, ["acme/none"])


def test_adapter_for_another_architecture_is_refused(hub):
    other = ZOO_ADAPTER.parents[1] / "tiny-qwen3.5-moe" / "attention"
    with pytest.raises(ValueError, match="attention"):
        resolve(MODEL, [str(other)])
