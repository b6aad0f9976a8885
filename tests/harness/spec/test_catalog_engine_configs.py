"""Full-size catalog checkpoints are laid out like the Hub repos: each config.json parses with the transformers of
every engine we pin (5.12.1 for SGLang 0.5.15, this venv's 5.17 for vLLM 0.25.1 / HF), layer cuts keep the pattern
strings consistent, and the tensors are written under the real checkpoint's names and shapes (checked at full width
on the meta device against a sample of each repo's index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lpdiff.harness.spec.catalog import FULL_CONFIGS, HUB_REPOS, INIT_RECIPE, get_model, hf_config
from lpdiff.harness.spec.checkpoint import checkpoint_tensors, hub_config_dict, write_checkpoint
from lpdiff.harness.spec.cut import cut_config
from lpdiff.harness.types import ModelSpec
from tests.helpers.configs import narrow_full_config

SGLANG_TRANSFORMERS = "5.12.1"  # the version SGLang 0.5.15 pins
# Where the throwaway venv with that transformers lives (built once, reused); LPDIFF_TF5121_VENV overrides.
VENV = Path(os.environ.get("LPDIFF_TF5121_VENV", Path.home() / ".cache" / "lpdiff" / "venv-transformers-5.12.1"))

# Expected checkpoint names -> shapes, a sample per repo. Names are the Hub index's spellings as stored public copies
# of those indexes quote them (Qwen3.5/3.6-35B-A3B: model.language_model.layers.N..., per-expert
# mlp.experts.E.gate_proj.weight; Nemotron-3 Nano/Super: backbone.layers.N.mixer..., Super's fc1/fc2_latent_proj
# of shape (latent, hidden)/(hidden, latent) and latent-width experts; gpt-oss bf16: fused
# mlp.experts.gate_up_proj (E, H, 2I)); shapes follow from each config.
EXPECTED = {
    "qwen3-30b-a3b": (
        1,
        {
            "model.embed_tokens.weight": (151936, 2048),
            "lm_head.weight": (151936, 2048),
            "model.layers.0.self_attn.q_proj.weight": (4096, 2048),
            "model.layers.0.self_attn.k_norm.weight": (128,),
            "model.layers.0.mlp.gate.weight": (128, 2048),
            "model.layers.0.mlp.experts.127.gate_proj.weight": (768, 2048),
            "model.layers.0.mlp.experts.0.down_proj.weight": (2048, 768),
        },
    ),
    "gpt-oss-20b": (
        1,
        {
            "model.layers.0.mlp.experts.gate_up_proj": (32, 2880, 5760),
            "model.layers.0.mlp.experts.gate_up_proj_bias": (32, 5760),
            "model.layers.0.mlp.experts.down_proj": (32, 2880, 2880),
            "model.layers.0.mlp.router.weight": (32, 2880),
            "model.layers.0.self_attn.sinks": (64,),
            "model.layers.0.self_attn.q_proj.bias": (4096,),
        },
    ),
    "qwen3.5-35b-a3b": (
        4,
        {
            "model.language_model.embed_tokens.weight": (248320, 2048),
            "lm_head.weight": (248320, 2048),
            "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": (8192, 2048),
            "model.language_model.layers.0.linear_attn.in_proj_z.weight": (4096, 2048),
            "model.language_model.layers.0.linear_attn.conv1d.weight": (8192, 1, 4),
            "model.language_model.layers.3.self_attn.q_proj.weight": (8192, 2048),
            "model.language_model.layers.0.mlp.experts.255.gate_proj.weight": (512, 2048),
            "model.language_model.layers.0.mlp.shared_expert_gate.weight": (1, 2048),
            "model.visual.merger.linear_fc1.weight": (4608, 4608),
        },
    ),
    "nemotron-3-nano-30b-a3b": (
        6,
        {
            "backbone.embeddings.weight": (131072, 2688),
            "backbone.norm_f.weight": (2688,),
            "backbone.layers.0.mixer.in_proj.weight": (10304, 2688),
            "backbone.layers.1.mixer.experts.127.up_proj.weight": (1856, 2688),
            "backbone.layers.1.mixer.gate.e_score_correction_bias": (128,),
            "backbone.layers.1.mixer.shared_experts.up_proj.weight": (3712, 2688),
            "backbone.layers.5.mixer.q_proj.weight": (4096, 2688),
        },
    ),
    "nemotron-3-super-120b-a12b": (
        2,
        {
            "backbone.layers.1.mixer.fc1_latent_proj.weight": (1024, 4096),
            "backbone.layers.1.mixer.fc2_latent_proj.weight": (4096, 1024),
            "backbone.layers.1.mixer.experts.511.up_proj.weight": (2688, 1024),
            "backbone.layers.1.mixer.experts.0.down_proj.weight": (1024, 2688),
            "backbone.layers.1.mixer.shared_experts.up_proj.weight": (5376, 4096),
            "backbone.layers.0.mixer.in_proj.weight": (18560, 4096),
        },
    ),
}


def test_hub_configs_are_the_shipped_spelling():
    assert set(FULL_CONFIGS) == set(HUB_REPOS) == set(EXPECTED)
    q35 = FULL_CONFIGS["qwen3.5-35b-a3b"]
    assert q35["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and q35["model_type"] == "qwen3_5_moe"
    assert q35["text_config"]["model_type"] == "qwen3_5_moe_text" and "vision_config" in q35
    for n in ("nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b"):
        c = FULL_CONFIGS[n]
        assert len(c["hybrid_override_pattern"]) == c["num_hidden_layers"] and "layers_block_type" not in c
        assert "auto_map" not in c and "quantization_config" not in c
    assert "quantization_config" not in FULL_CONFIGS["gpt-oss-20b"]
    assert FULL_CONFIGS["qwen3-30b-a3b"]["num_experts"] == 128  # the Hub spelling, not num_local_experts
    sup = hf_config(get_model("nemotron-3-super-120b-a12b"))
    assert (sup.hidden_size, sup.n_routed_experts, sup.num_experts_per_tok, sup.num_hidden_layers) == (
        4096,
        512,
        22,
        88,
    )
    assert (sup.moe_latent_size, sup.routed_scaling_factor) == (1024, 5.0)


@pytest.mark.parametrize(
    "name,n",
    [
        ("qwen3.5-35b-a3b", 5),
        ("nemotron-3-nano-30b-a3b", 7),
        ("nemotron-3-super-120b-a12b", 9),
        ("gpt-oss-20b", 3),
        ("qwen3-30b-a3b", 2),
    ],
)
def test_cut_keeps_per_layer_fields_consistent(name, n):
    cut = cut_config(FULL_CONFIGS[name], n)
    t = cut.get("text_config", cut)
    assert t["num_hidden_layers"] == n
    if "hybrid_override_pattern" in t:
        assert t["hybrid_override_pattern"] == FULL_CONFIGS[name]["hybrid_override_pattern"][:n]
    if "layer_types" in t:
        assert len(t["layer_types"]) == n
    assert FULL_CONFIGS[name] != cut  # a copy: the catalog's dict is untouched
    with pytest.raises(ValueError, match="num-layers"):
        cut_config(FULL_CONFIGS[name], 1000)


def _write_configs(root: Path) -> dict[str, Path]:
    out = {}
    for name in FULL_CONFIGS:
        for n in (None, 4):
            d = root / f"{name}-{n or 'full'}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps(cut_config(FULL_CONFIGS[name], n)))
            out[d.name] = d
    return out


_PARSE = """
import json, sys
from transformers import AutoConfig
out = {}
for name, d in json.loads(sys.argv[1]).items():
    c = AutoConfig.from_pretrained(d)
    t = c.get_text_config()
    kinds = getattr(t, "layers_block_type", None) or getattr(t, "layer_types", None)
    out[name] = [type(c).__name__, t.num_hidden_layers, len(kinds) if kinds else None]
print(json.dumps(out))
"""


def _parse_with(python: str, dirs: dict[str, Path]) -> dict:
    r = subprocess.run(
        [python, "-c", _PARSE, json.dumps({k: str(v) for k, v in dirs.items()})],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_parsed(got: dict) -> None:
    for key, (cls, layers, kinds) in got.items():
        want = 4 if key.endswith("-4") else None
        assert want is None or layers == want, (key, layers)
        assert kinds is None or kinds == layers, (key, kinds, layers)
        if key.startswith("qwen3.5"):
            assert cls == "Qwen3_5MoeConfig"


def test_configs_parse_with_this_transformers(tmp_path):
    _check_parsed(_parse_with(sys.executable, _write_configs(tmp_path)))


def _sglang_transformers_python() -> str:
    py = VENV / "bin" / "python"
    if not py.exists():
        r = subprocess.run([sys.executable, "-m", "venv", str(VENV)], capture_output=True, text=True, check=False)
        if r.returncode == 0:
            r = subprocess.run(
                [str(py), "-m", "pip", "install", "-q", f"transformers=={SGLANG_TRANSFORMERS}"],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        if r.returncode != 0:
            import shutil

            shutil.rmtree(VENV, ignore_errors=True)
            pytest.skip(
                f"cannot build a venv with transformers=={SGLANG_TRANSFORMERS} (offline?): "
                f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}"
            )
    return str(py)


@pytest.mark.slow  # a fresh clone pip-installs transformers 5.12.1 into its own venv first: a minute or more
def test_configs_parse_with_sglang_transformers(tmp_path):
    """SGLang 0.5.15 pins transformers 5.12.1, whose NemotronH config refuses transformers 5.17's own
    layers_block_type values; the Hub's hybrid_override_pattern is what it reads."""
    py = _sglang_transformers_python()
    ver = subprocess.run(
        [py, "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True, check=False
    ).stdout.strip()
    assert ver == SGLANG_TRANSFORMERS
    _check_parsed(_parse_with(py, _write_configs(tmp_path)))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_checkpoint_names_and_shapes_at_full_width(name):
    """Built on the meta device at full width (nothing allocated), written names and shapes match the repo's."""
    from transformers import AutoModelForCausalLM

    depth, want = EXPECTED[name]
    spec = get_model(name, num_layers=depth)
    cfg = hf_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM._model_mapping[type(cfg)]._from_config(cfg, dtype=torch.bfloat16)
    got = checkpoint_tensors(model, hub_config_dict(spec))
    for k, shape in want.items():
        assert k in got, f"{name}: {k} not written; near: {sorted(x for x in got if k.split('.')[-2] in x)[:5]}"
        assert tuple(got[k].shape) == shape, (k, tuple(got[k].shape), shape)
    fused = [k for k in got if k.endswith("experts.gate_up_proj")]
    assert bool(fused) == (name == "gpt-oss-20b")  # per-expert on disk except gpt-oss
    assert not any(k.startswith("model.layers.") for k in got) or not name.startswith(("qwen3.5", "nemotron"))


@pytest.mark.parametrize("name,depth", [("qwen3.5-35b-a3b", 4), ("nemotron-3-super-120b-a12b", 6), ("gpt-oss-20b", 2)])
def test_written_checkpoint_loads_back_identically(tmp_path, name, depth):
    """write_checkpoint -> config.json is the Hub file cut to depth, shards + index, and transformers'
    from_pretrained on the directory gives the in-memory model's logits exactly."""
    from transformers import AutoModelForCausalLM

    from lpdiff.harness.spec.catalog import load_hf_model

    cfg = narrow_full_config(name)
    spec = ModelSpec(name="t", arch=name, config=cfg, init_seed=0, init_recipe=INIT_RECIPE, num_layers=depth)
    model = load_hf_model(spec, torch.float32, "cpu")
    out = write_checkpoint(model, spec, tmp_path / "ckpt", shard_bytes=200_000)
    written = json.loads((out / "config.json").read_text())
    want = cut_config(cfg, depth)
    for d in (written, written.get("text_config")):
        if isinstance(d, dict):
            d.pop("torch_dtype", None), d.pop("dtype", None)
    for d in (want, want.get("text_config")):
        if isinstance(d, dict):
            d.pop("torch_dtype", None), d.pop("dtype", None)
    assert written == want
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s.startswith("model-0000") for s in shards)
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == shard}
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.arange(2, 14)[None]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, back(input_ids=ids, use_cache=False).logits)
