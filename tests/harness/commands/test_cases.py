"""Trainer test cases (``lpdiff run --case``): a case directory in SGLang's layout built from a zoo model — HF+PEFT
in fp32 as the "trainer", the same in bf16 as the "original sampler", saved with torch.save of plain tensors and
lists — is judged with the case's own noise shown; pickled objects, foreign token ids and the JSONL form; the
hf:// form read from an HF_HOME laid out as huggingface_hub writes it, offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpdiff.harness.cli import main
from lpdiff.harness.spec.cases import CaseError, load_case, threshold_for
from lpdiff.harness.spec.catalog import get_model, load_hf_model
from lpdiff.harness.spec.prompts import prompt_set
from lpdiff.harness.spec.resolve import zoo_adapters

MODEL = "tiny-qwen3-moe"
ADAPTER = zoo_adapters(MODEL)["all"].path


def _peft_logprobs(dtype: torch.dtype, prompts: list[list[int]]) -> list[torch.Tensor]:
    """log p(tokens[i] | tokens[:i]) for i >= 1 from transformers + PEFT, as a trainer computes them."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf_model(get_model(MODEL), dtype, "cpu"), ADAPTER).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1]
            out.append(lp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory) -> Path:
    """SGLang's layout: the adapter at the dataset root, compare_sample_train_data.pt beside it (one prompt, flat
    logprobs for positions 1..n-1, as its tests pass cdata["tokens"] straight to the engine)."""
    d = tmp_path_factory.mktemp("case") / "lora-test-case-tiny"
    shutil.copytree(ADAPTER, d)
    tokens = prompt_set(MODEL, "default")[0][:40]
    train, sample = _peft_logprobs(torch.float32, [tokens])[0], _peft_logprobs(torch.bfloat16, [tokens])[0]
    torch.save(
        {"tokens": torch.tensor(tokens), "training_logprobs": train.tolist(), "sampling_logprobs": sample},
        d / "compare_sample_train_data.pt",
    )
    return d


def test_load_case_layout(case_dir):
    case = load_case(str(case_dir))
    n = len(case.prompts[0])
    assert case.adapter_dir == case_dir and len(case.prompts) == 1 and n >= 16
    assert case.training[0].shape == (n - 1,) and case.sampling[0].shape == (n - 1,)
    assert case.threshold == 5e-3  # no case.json: the default of SGLang's tests
    assert threshold_for("Qwen/Qwen3.5-35B-A3B") == 1e-3
    assert threshold_for("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16") == 2.5e-3


def test_run_case_triton_shows_case_noise(case_dir, tmp_path, capsys):
    out_json = tmp_path / "v.json"
    rc = main(["run", "--case", str(case_dir), "--model", MODEL, "--engine", "triton", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("PASS") and "kl_v2(trainer, original sampler)" in out and "the case's own noise" in out
    v = json.loads(out_json.read_text())
    assert v["kl_v2_engine_trainer"] < 1e-6  # triton fp32 vs HF+PEFT fp32
    assert v["kl_v2_sampler_trainer"] > v["kl_v2_engine_trainer"]  # bf16 sampler is the noisier one
    assert v["adapter_changes_output"] and v["lora_vs_base_max_abs"] > 1e-3


def test_case_fails_when_engine_leaves_trainer(case_dir, tmp_path, capsys):
    """The verdict can fail: trainer logprobs shifted by 0.2 give kl_v2 0.02 > 5e-3 -> exit 1."""
    bad = tmp_path / "shifted"
    shutil.copytree(case_dir, bad)
    data = torch.load(bad / "compare_sample_train_data.pt", weights_only=True)
    data["training_logprobs"] = [x - 0.2 for x in data["training_logprobs"]]
    torch.save(data, bad / "compare_sample_train_data.pt")
    rc = main(["run", "--case", str(bad), "--model", MODEL, "--engine", "hf"])
    out = capsys.readouterr().out
    assert rc == 1 and out.startswith("FAIL") and "kl_v2(trainer, engine)" in out


class Opaque:
    """A custom object: pickled by torch.save, refused by torch.load(weights_only=True)."""

    value = 1


def test_pickled_object_is_refused(case_dir, tmp_path, capsys):
    bad = tmp_path / "pickled"
    shutil.copytree(case_dir, bad)
    data = torch.load(bad / "compare_sample_train_data.pt", weights_only=True)
    data["meta"] = Opaque()
    torch.save(data, bad / "compare_sample_train_data.pt")
    rc = main(["run", "--case", str(bad), "--model", MODEL, "--engine", "hf"])
    err = capsys.readouterr().err
    assert rc == 2 and "compare_sample_train_data.pt" in err and "never unpickles" in err
    assert "Traceback" not in err


def test_tokens_outside_vocab_are_refused(case_dir, tmp_path, capsys):
    bad = tmp_path / "foreign"
    shutil.copytree(case_dir, bad)
    data = torch.load(bad / "compare_sample_train_data.pt", weights_only=True)
    data["tokens"][3] = 151000  # a Qwen3 id; the zoo vocabulary has 1024
    torch.save(data, bad / "compare_sample_train_data.pt")
    rc = main(["run", "--case", str(bad), "--model", MODEL, "--engine", "hf"])
    err = capsys.readouterr().err
    assert rc == 2 and "outside the model's vocabulary" in err and "151000" in err


def test_jsonl_form_and_bad_lengths(case_dir, tmp_path):
    d = tmp_path / "jsonl"
    shutil.copytree(ADAPTER, d / "adapter")  # adapter in a subfolder
    data = torch.load(case_dir / "compare_sample_train_data.pt", weights_only=True)
    row = {
        "tokens": data["tokens"].tolist(),
        "logprobs": data["training_logprobs"],
        "sampler_logprobs": data["sampling_logprobs"].tolist(),
    }
    (d / "reference.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    (d / "case.json").write_text(json.dumps({"base_model": MODEL, "kl_threshold": 1e-4, "trainer": "fsdp"}))
    case = load_case(str(d))
    assert case.adapter_dir == d / "adapter" and len(case.prompts) == 2 and case.threshold == 1e-4
    assert case.base_model == MODEL
    row["logprobs"] = row["logprobs"][:-1]
    (d / "reference.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(CaseError, match=r"positions 1..n-1"):
        load_case(str(d))


def _hf_cache_layout(hf_home: Path, repo: str, files: Path) -> str:
    """Lay out a dataset snapshot the way huggingface_hub writes it: blobs by sha256, refs/main, snapshots/<sha>
    with symlinks into blobs."""
    import hashlib

    sha = hashlib.sha1(repo.encode()).hexdigest()  # any 40-hex commit id
    root = hf_home / "hub" / f"datasets--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    snap = root / "snapshots" / sha
    for f in files.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            link = snap / f.relative_to(files)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return sha


def test_hf_case_offline_from_hf_home(case_dir, tmp_path):
    """hf://datasets/ORG/NAME and @<commit> are served by huggingface_hub's snapshot_download from the cache with
    HF_HUB_OFFLINE=1 (set before huggingface_hub is imported: a fresh interpreter); an unknown revision is one
    clear error."""
    hf_home = tmp_path / "hf"
    sha = _hf_cache_layout(hf_home, "someorg/lora-test-case-tiny", case_dir)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = (
        "import sys; from lpdiff.harness.spec.cases import load_case\n"
        "c = load_case(sys.argv[1]); print(c.root.name, len(c.prompts[0]), c.adapter_dir == c.root)"
    )
    for src in ("hf://datasets/someorg/lora-test-case-tiny", f"hf://datasets/someorg/lora-test-case-tiny@{sha}"):
        r = subprocess.run(
            [sys.executable, "-c", code, src], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == [sha, str(len(load_case(str(case_dir)).prompts[0])), "True"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpdiff.harness.cli",
            "run",
            "--case",
            "hf://datasets/someorg/lora-test-case-tiny@" + "0" * 40,
            "--model",
            MODEL,
            "--engine",
            "hf",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and "cannot be fetched" in r.stderr and "hf download --repo-type dataset" in r.stderr


def test_case_base_model_as_own_dir_or_hub_id(case_dir, tmp_path, monkeypatch, capsys):
    """--model resolves as `lpdiff run --model` does: a checkpoint directory of one's own (a copy of the zoo
    checkpoint) and a Hub id served from an HF cache laid out as huggingface_hub writes it, offline. Both exited 2
    "unknown model" before."""
    from lpdiff.harness.spec.catalog import ZOO_DIR
    from tests.helpers.hf_cache import offline_home, populate

    hub = offline_home(monkeypatch, tmp_path)
    own = tmp_path / "my-model"
    shutil.copytree(ZOO_DIR / MODEL, own)
    populate(hub, "acme/tiny-moe", ZOO_DIR / MODEL)
    for model in (str(own), "acme/tiny-moe"):
        out_json = tmp_path / "v.json"
        rc = main(["run", "--case", str(case_dir), "--model", model, "--engine", "hf", "--json", str(out_json)])
        out = capsys.readouterr().out
        assert rc == 0 and out.startswith("PASS"), out
        v = json.loads(out_json.read_text())
        assert v["kl_v2_engine_trainer"] < 1e-9 and v["adapter_changes_output"]
    assert main(["run", "--case", str(case_dir), "--model", "acme/nope", "--engine", "hf"]) == 2
    assert "hf download acme/nope" in capsys.readouterr().err


def test_catalog_hub_id_is_the_cached_checkpoint_else_the_catalog(case_dir, tmp_path, monkeypatch, capsys):
    """docs/cases.md's `--model Qwen/Qwen3.5-35B-A3B`: with no snapshot cached it is the catalog's config-built
    qwen3.5-35b-a3b (said on stderr with the download command); with one cached, that checkpoint, and the case is
    judged at SGLang's threshold for that model (1e-3). The cached "Qwen/Qwen3.5-35B-A3B" here holds the tiny
    Qwen3-MoE zoo checkpoint the case was made for: only the name matters to the lookup, and a 35B run is no CPU
    test."""
    from lpdiff.harness.commands.case import case_model
    from lpdiff.harness.spec.catalog import ZOO_DIR
    from lpdiff.harness.spec.resolve import SpecError
    from tests.helpers.hf_cache import offline_home, populate

    hub = offline_home(monkeypatch, tmp_path)
    said = []
    spec = case_model("Qwen/Qwen3.5-35B-A3B", log=said.append)
    assert (spec.name, spec.path, spec.arch) == ("qwen3.5-35b-a3b", None, "qwen3_5_moe_text")
    assert "hf download Qwen/Qwen3.5-35B-A3B" in said[0] and "will FAIL" in said[0]
    assert case_model("openai/gpt-oss-20b", num_layers=2).name == "gpt-oss-20b"
    with pytest.raises(SpecError, match=r"hf download Qwen/Qwen3.5-35B-A3B --revision v2"):
        case_model("Qwen/Qwen3.5-35B-A3B@v2")  # a pinned revision asks for the real checkpoint
    snap, _ = populate(hub, "Qwen/Qwen3.5-35B-A3B", ZOO_DIR / MODEL)
    assert case_model("Qwen/Qwen3.5-35B-A3B").path == str(snap)
    out_json = tmp_path / "v.json"
    rc = main(
        ["run", "--case", str(case_dir), "--model", "Qwen/Qwen3.5-35B-A3B", "--engine", "hf", "--json", str(out_json)]
    )
    assert rc == 0, capsys.readouterr()
    assert json.loads(out_json.read_text())["threshold"] == 1e-3
