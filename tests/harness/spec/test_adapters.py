"""lpdiff.harness.spec.adapters against PEFT itself: generated adapters change the model, the canonical form reproduces
PEFT's merge_and_unload, conversions are exact, and bad requests fail with one clear error.

Tiny random models are built in tests/helpers/adapters.py from transformers configs (hidden 32, expert width 24 so that
no two of hidden, width and 2*width coincide: a transposed or swapped matrix cannot pass a shape check by accident)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lpdiff.harness.spec import adapters as ad
from lpdiff.harness.types import dir_hash
from tests.helpers.adapters import (
    ATOL,
    E,
    H,
    R,
    changed,
    max_diff,
    peft_merged,
    per_expert_merged,
    tiny_config,
    tiny_model,
)
from tests.helpers.paths import REPO

# Every group each architecture has, so one adapter exercises all its dense and expert targets.
ALL_GROUPS = {
    "qwen3_moe": ["attention", "experts"],
    "gpt_oss": ["attention", "experts"],
    "qwen3_5_moe_text": ["attention", "linear_attention", "shared_expert", "experts"],
    "nemotron_h": ["attention", "mamba", "shared_expert", "experts"],
}
MOE = [
    pytest.param("qwen3_moe", id="qwen3_moe"),  # [gate; up] concatenated, (E, out, in)
    pytest.param("gpt_oss", id="gpt_oss"),  # interleaved gate/up, (E, in, out) transposed, attention biases
    pytest.param("qwen3_5_moe_text", id="qwen3_5"),  # linear attention + shared expert next to routed experts
    pytest.param("nemotron_h", id="nemotron_h"),  # non-gated up/down experts, mamba in_proj, `mixer.` paths
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One peft3d adapter per architecture with all its groups (seed 1)."""
    root = tmp_path_factory.mktemp("gen")
    return {
        arch: Path(ad.generate_adapter(tiny_model(arch), root / arch, ALL_GROUPS[arch], rank=R, alpha=8, seed=1).path)
        for arch in ALL_GROUPS
    }


def logprobs(model, ids):
    with torch.no_grad():
        lp = model(ids).logits.float().log_softmax(-1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


# -- generator -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE)
def test_generated_adapter_is_nonzero_and_moves_logprobs(arch, generated):
    from peft import PeftModel

    model = tiny_model(arch)
    tensors = load_file(f"{generated[arch]}/adapter_model.safetensors")
    assert any(".experts." in k for k in tensors) and any(".experts." not in k for k in tensors)
    for k, t in tensors.items():
        assert t.dtype == torch.float32 and t.abs().sum() > 0, k
        if ".experts." in k:  # every expert's slice is non-zero, not just the stack
            per_e = t.reshape(E, R, -1) if "lora_A" in k else t.reshape(t.shape[0], R, E).permute(2, 0, 1)
            assert (per_e.flatten(1).abs().sum(1) > 0).all(), k
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(copy.deepcopy(model), generated[arch]).eval()
    d = logprobs(peft, ids) - logprobs(model, ids)
    # Visible but not destructive, on random-init tiny models whose distributions are near uniform.
    assert 1e-3 < d.abs().mean() < 1.0 and d.isfinite().all(), d.abs().mean()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("tiny-qwen3-moe", id="qwen3_moe"),  # the trained zoo: peaked distributions, unlike random init
        pytest.param("tiny-gpt-oss", id="gpt_oss"),
        pytest.param("tiny-qwen3.5-moe", id="qwen3_5"),
        pytest.param("tiny-nemotron-h", id="nemotron_h"),
    ],
)
def test_default_scale_moves_zoo_logprobs_visibly_not_destructively(name, tmp_path):
    from peft import PeftModel

    from lpdiff.harness.spec.catalog import get_model, load_hf_model
    from lpdiff.harness.spec.prompts import prompt_set

    model = load_hf_model(get_model(name), torch.float32, "cpu")
    ids = torch.tensor([p[:24] for p in prompt_set(name, "default")])  # ragged set: cut to the shortest
    path = ad.generate_adapter(model, tmp_path / "a", ["attention", "experts"], seed=0).path
    base = logprobs(model, ids)  # before PEFT wraps the model in place
    d = logprobs(PeftModel.from_pretrained(model, path).eval(), ids) - base
    assert 0.05 < d.abs().mean() < 1.0 and d.abs().max() < 5.0, (d.abs().mean(), d.abs().max())


def test_experts_only_adapter_gets_no_default_dense_targets(tmp_path):
    """PEFT replaces target_modules=None by its per-model defaults (nemotron_h: q/k/v/o_proj) even when
    target_parameters are set; generated configs must say [] so that loading adds nothing."""
    from peft import PeftModel

    model = tiny_model("nemotron_h")
    path = ad.generate_adapter(model, tmp_path / "e", ["experts"], seed=0).path
    assert json.loads((Path(path) / "adapter_config.json").read_text())["target_modules"] == []
    peft = PeftModel.from_pretrained(copy.deepcopy(model), path)
    assert peft.base_model.targeted_module_names == [] and len(peft.base_model.targeted_parameter_names) == 4


def test_seed_is_deterministic_and_tensors_independent_of_other_groups(tmp_path):
    model = tiny_model("qwen3_moe")
    a = ad.generate_adapter(model, tmp_path / "a", ["attention", "experts"], seed=3).path
    b = ad.generate_adapter(model, tmp_path / "b", ["attention", "experts"], seed=3).path
    c = ad.generate_adapter(model, tmp_path / "c", ["attention", "experts"], seed=4).path
    only_attn = ad.generate_adapter(model, tmp_path / "d", ["attention"], seed=3).path
    w = {n: load_file(f"{p}/adapter_model.safetensors") for n, p in [("a", a), ("b", b), ("c", c), ("d", only_attn)]}
    assert dir_hash(a) == dir_hash(b)
    assert all(not torch.equal(w["a"][k], w["c"][k]) for k in w["a"])
    assert all(torch.equal(w["d"][k], w["a"][k]) for k in w["d"])  # adding a group does not reseed the others


def test_generated_dir_is_byte_stable_across_processes(tmp_path):
    """Adapter directories are content-hashed into baseline keys: PYTHONHASHSEED (set iteration order inside PEFT's
    save) must not change a byte."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM; "
        "from lpdiff.harness.spec import adapters as ad; "
        "from tests.helpers.adapters import tiny_config; torch.manual_seed(0); "
        "m = AutoModelForCausalLM.from_config(tiny_config('qwen3_moe')); "
        "ad.generate_adapter(m, sys.argv[1], ['attention', 'experts'], seed=0)"
    )
    repo = str(REPO)
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=repo)
        subprocess.run([sys.executable, "-c", code, str(tmp_path / seed)], env=env, check=True, cwd=repo)
    assert dir_hash(tmp_path / "1") == dir_hash(tmp_path / "2")


def test_per_expert_layout_generation_equals_conversion(tmp_path):
    model = tiny_model("gpt_oss")
    direct = ad.generate_adapter(model, tmp_path / "pe", ["attention", "experts"], seed=7, layout="per_expert").path
    via = ad.generate_adapter(model, tmp_path / "3d", ["attention", "experts"], seed=7).path
    conv = ad.convert_adapter(via, tmp_path / "conv", "per_expert", model.config).path
    a, b = load_file(f"{direct}/adapter_model.safetensors"), load_file(f"{conv}/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ad.inspect_adapter(direct).provenance["generated"]["layout"] == "per_expert"


def test_shared_outer(tmp_path):
    model = tiny_model("qwen3_moe")
    path = ad.generate_adapter(model, tmp_path / "s", ["experts"], rank=R, seed=2, shared_outer=True).path
    canon = ad.load_canonical(path, model.config)
    for name, (a, b) in canon.experts.items():
        if name.endswith("gate_up_proj"):
            assert all(torch.equal(a[e], a[0]) for e in range(E)) and not torch.equal(b[1], b[0])
        else:
            assert all(torch.equal(b[e], b[0]) for e in range(E)) and not torch.equal(a[1], a[0])
    merged = peft_merged(model, path)
    assert max_diff(ad.merge_into(copy.deepcopy(model), canon).state_dict(), merged) <= ATOL


# -- canonical form == PEFT --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE)
def test_canonical_reproduces_peft_merge(arch, generated):
    model = tiny_model(arch)
    canon = ad.load_canonical(generated[arch], model.config)
    merged = peft_merged(model, generated[arch])
    ours = ad.merge_into(copy.deepcopy(model), canon).state_dict()
    assert max_diff(ours, merged) <= ATOL
    # PEFT changed exactly the weights the canonical form has, dense and expert alike.
    touched = {f"{n}.weight" for n in canon.dense} | set(canon.experts)
    assert changed(merged, model) == touched and canon.dense and canon.experts
    for name, (a, b) in canon.experts.items():
        assert a.shape[:2] == (E, R) and b.shape[0] == E and b.shape[2] == R, name


def test_dense_model_adapter(tmp_path):
    model = tiny_model("qwen3")  # a dense model: layout dense_only, the mlp group
    path = ad.generate_adapter(model, tmp_path / "d", ["attention", "mlp"], rank=R, seed=0).path
    info = ad.inspect_adapter(path)
    assert info.layout == "dense_only" and info.groups == ["attention", "mlp"] and info.num_experts is None
    canon = ad.load_canonical(path, model.config)
    assert max_diff(ad.merge_into(copy.deepcopy(model), canon).state_dict(), peft_merged(model, path)) <= ATOL


# -- converters ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE)
def test_roundtrip_3d_per_expert_3d_is_exact(arch, generated, tmp_path):
    model = tiny_model(arch)
    pe = ad.convert_adapter(generated[arch], tmp_path / "pe", "per_expert", model.config).path
    back = ad.convert_adapter(pe, tmp_path / "back", "peft3d", model.config).path
    src, dst = load_file(f"{generated[arch]}/adapter_model.safetensors"), load_file(f"{back}/adapter_model.safetensors")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)
    cfg_src, cfg_dst = (json.loads((Path(p) / "adapter_config.json").read_text()) for p in (generated[arch], back))
    assert (cfg_dst["r"], cfg_dst["lora_alpha"]) == (cfg_src["r"], cfg_src["lora_alpha"])
    assert sorted(cfg_dst["target_parameters"]) == sorted(cfg_src["target_parameters"])
    info = ad.inspect_adapter(pe)
    assert info.layout == "per_expert" and info.num_experts == E and info.rank == R
    assert ad.inspect_adapter(generated[arch]).layout == "peft3d"


@pytest.mark.parametrize("arch", MOE)
def test_per_expert_files_match_peft_merge(arch, generated, tmp_path):
    """Read per-expert files with HF's own row conventions: a concat/interleave mix-up (gpt-oss) or a gate/up swap
    fails here, because the reference is PEFT's merge of the 3D adapter, not our reader."""
    model = tiny_model(arch)
    pe = ad.convert_adapter(generated[arch], tmp_path / "pe", "per_expert", model.config).path
    expected = per_expert_merged(model, tmp_path / "pe", arch)
    assert max_diff(expected, peft_merged(model, generated[arch])) <= ATOL
    keys = load_file(f"{pe}/adapter_model.safetensors").keys()
    parts = {k.split(".")[-3] for k in keys if ".experts." in k}
    assert parts == ({"up_proj", "down_proj"} if arch == "nemotron_h" else {"gate_proj", "up_proj", "down_proj"})


@pytest.mark.parametrize("arch", MOE)
def test_per_expert_gate_layout(arch, generated, tmp_path):
    """SGLang's reading of non-gated experts: Nemotron-H's expert input saved as experts.{e}.gate_proj (the same
    tensors as per_expert's up_proj); gated experts are written exactly as per_expert. Both round-trip to the
    PEFT 3D source bit for bit."""
    model = tiny_model(arch)
    pe = ad.convert_adapter(generated[arch], tmp_path / "pe", "per_expert", model.config).path
    pg = ad.convert_adapter(generated[arch], tmp_path / "pg", "per_expert_gate", model.config).path
    a, b = load_file(f"{pe}/adapter_model.safetensors"), load_file(f"{pg}/adapter_model.safetensors")
    rename = (lambda k: re.sub(r"(\.experts\.\d+)\.up_proj\.", r"\1.gate_proj.", k)) if arch == "nemotron_h" else str
    assert {rename(k) for k in a} == set(b) and all(torch.equal(a[k], b[rename(k)]) for k in a)
    parts = {k.split(".")[-3] for k in b if ".experts." in k}
    assert parts == ({"gate_proj", "down_proj"} if arch == "nemotron_h" else {"gate_proj", "up_proj", "down_proj"})
    # the file alone cannot tell gate_proj-named non-gated experts from gated ones; the model can
    assert ad.inspect_adapter(pg).layout == "per_expert"
    assert ad.load_canonical(pg, model.config).layout == ("per_expert_gate" if arch == "nemotron_h" else "per_expert")
    back = ad.convert_adapter(pg, tmp_path / "back", "peft3d", model.config).path
    src, dst = load_file(f"{generated[arch]}/adapter_model.safetensors"), load_file(f"{back}/adapter_model.safetensors")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param("qwen3_moe", id="qwen3_moe"),  # block B over [gate; up] halves
        pytest.param("gpt_oss", id="gpt_oss"),  # block B over interleaved rows
    ],
)
def test_per_expert_with_distinct_gate_up_A_stacks_to_rank_2r(arch, generated, tmp_path):
    model = tiny_model(arch)
    pe = tmp_path / "pe"
    ad.convert_adapter(generated[arch], pe, "per_expert", model.config)
    tensors = load_file(pe / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(5)
    for k in tensors:  # give every expert's up_proj its own A: no rank-r fused form exists any more
        if ".up_proj.lora_A" in k:
            tensors[k] = torch.randn(tensors[k].shape, generator=g) * tensors[k].std()
    save_file(tensors, pe / "adapter_model.safetensors")
    out = ad.convert_adapter(pe, tmp_path / "3d", "peft3d", model.config).path
    cfg = json.loads((tmp_path / "3d" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (2 * R, 2 * 8)
    step = ad.inspect_adapter(out).provenance["conversions"][-1]
    assert step["rank"] == [R, 2 * R] and "different A" in step["why"]
    assert max_diff(peft_merged(model, out), per_expert_merged(model, pe, arch)) <= ATOL


def test_rank_change_under_rslora_is_refused(tmp_path):
    model = tiny_model("qwen3_moe")
    # rank 8 -> 16 under rslora needs alpha * sqrt(2): 16*sqrt(2)/sqrt(16) != 16/sqrt(8) in floats (at rank 4
    # it happens to round to the same scaling, and the conversion is then allowed)
    src = ad.generate_adapter(model, tmp_path / "r", ["experts"], rank=8, alpha=16, seed=0, use_rslora=True).path
    pe = tmp_path / "pe"
    ad.convert_adapter(src, pe, "per_expert", model.config)
    tensors = load_file(pe / "adapter_model.safetensors")
    for k in tensors:
        if ".up_proj.lora_A" in k:
            tensors[k] = tensors[k].flip(0)
    save_file(tensors, pe / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="refusing to approximate"):
        ad.convert_adapter(pe, tmp_path / "3d", "peft3d", model.config)


@pytest.mark.parametrize(
    "arch,root",
    [
        pytest.param("nemotron_h", "backbone", id="nemotron-backbone"),  # Nemotron-H checkpoints' on-disk decoder name
        pytest.param("qwen3_5_moe_text", "model.language_model", id="qwen3_5-language_model"),  # multimodal Qwen3.5
    ],
)
def test_on_disk_decoder_root(arch, root, generated, tmp_path):
    model = tiny_model(arch)
    src = generated[arch]
    pe = ad.convert_adapter(src, tmp_path / "pe", "per_expert", model.config, disk_root=root).path
    keys = load_file(f"{pe}/adapter_model.safetensors").keys()
    assert all(k.startswith(f"base_model.model.{root}.layers.") for k in keys)
    a, b = ad.load_canonical(src, model.config), ad.load_canonical(pe, model.config)
    assert a.dense.keys() == b.dense.keys() and a.experts.keys() == b.experts.keys()
    assert all(k.startswith("model.layers.") for k in [*b.dense, *b.experts])
    assert all(torch.equal(x, y) for k in a.experts for x, y in zip(a.experts[k], b.experts[k]))
    back = ad.convert_adapter(pe, tmp_path / "back", "peft3d", model.config).path  # in-memory names again
    s, d = load_file(f"{src}/adapter_model.safetensors"), load_file(f"{back}/adapter_model.safetensors")
    assert s.keys() == d.keys() and all(torch.equal(s[k], d[k]) for k in s)
    assert max_diff(peft_merged(model, back), per_expert_merged(model, tmp_path / "pe", arch)) <= ATOL


# -- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,target",
    [
        pytest.param("qwen3_moe", "router", id="group-router"),  # the word itself
        pytest.param("qwen3_moe", "mlp.gate", id="qwen3-mlp.gate"),  # qwen's router module is called gate
        pytest.param("gpt_oss", "mlp.router", id="gpt_oss-router"),  # gpt-oss calls it router
        pytest.param("qwen3_5_moe_text", "shared_expert_gate", id="qwen3_5-shared-gate"),  # a gate that is an nn.Linear
    ],
)
def test_router_targets_are_refused(arch, target, tmp_path):
    with pytest.raises(ValueError, match=r"router/gate.*not supported"):
        ad.generate_adapter(tiny_model(arch), tmp_path / "x", ["attention", target])


@pytest.mark.parametrize(
    "arch,target,match",
    [
        pytest.param("qwen3_moe", "linear_attention", "matches nothing", id="no-linear-attn"),  # qwen3 has none
        pytest.param("gpt_oss", "shared_expert", "matches nothing", id="no-shared-expert"),  # gpt-oss has none
        pytest.param("qwen3_moe", "self_attn.qq_proj", "matches nothing", id="typo"),  # an explicit suffix
        pytest.param("nemotron_h", "mixer.out_proj", "PEFT refuses", id="mamba-out_proj"),  # PEFT raises on it
        pytest.param("qwen3_moe_dense_layer", "mlp", "PEFT did not target exactly", id="qwen3-dense-mlp"),  # PEFT
        # rewrites gate/up/down_proj targets to the experts on qwen2-style MoE models
    ],
)
def test_bad_targets_fail_clearly(arch, target, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        ad.generate_adapter(tiny_model(arch), tmp_path / "x", [target])


def test_adapter_for_another_model_fails_clearly(generated):
    other = tiny_config("qwen3_moe")
    other.hidden_size, other.head_dim = 48, 12
    with pytest.raises(ValueError, match="another model size"):
        ad.load_canonical(generated["qwen3_moe"], other)
    with pytest.raises(ValueError, match="no module"):
        ad.load_canonical(generated["qwen3_5_moe_text"], tiny_config("qwen3_moe"))


def test_inspect_adapter(generated):
    info = ad.inspect_adapter(generated["qwen3_5_moe_text"])
    assert info.layout == "peft3d" and (info.rank, info.alpha, info.rslora) == (R, 8.0, False)
    assert info.groups == ["attention", "experts", "linear_attention", "shared_expert"]
    assert info.num_experts == E and info.dtypes == ["F32"]
    assert sorted(info.target_parameters) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert "shared_expert.gate_proj" in info.target_modules  # a bare gate_proj would also name expert projections
    assert info.provenance["generated"]["seed"] == 1
    k = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"  # gate_up: the inner wrapper
    assert info.shapes[k] == (R * E, H)


def test_latent_group_on_nemotron_super_matches_peft_merge(tmp_path):
    """Nemotron-3-Super's latent MoE projections (fc1_latent_proj hidden -> latent, fc2_latent_proj back) are their
    own group: an adapter of that group alone touches exactly them, and lpdiff's merge equals PEFT's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.configs import narrow_full_config

    kw = narrow_full_config("nemotron-3-super-120b-a12b")
    kw["num_hidden_layers"] = 4
    kw["hybrid_override_pattern"] = kw["hybrid_override_pattern"][:4]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).float().eval()
    layout = ad.ModelLayout.of(model)
    latent = {n for n in layout.linears if ad.module_group(n) == "latent"}
    assert latent and all(n.rsplit(".", 1)[-1] in ("fc1_latent_proj", "fc2_latent_proj") for n in latent)
    path = ad.generate_adapter(model, tmp_path / "latent", ["latent"], rank=R, seed=3).path
    assert ad.inspect_adapter(path).groups == ["latent"]
    merged = ad.merge_into(copy.deepcopy(model), ad.load_canonical(path, model.config)).state_dict()
    assert {k.removesuffix(".weight") for k in changed(merged, model)} == latent
    assert max_diff(merged, peft_merged(model, path)) <= ATOL


def test_peft3d_expert_count_reads_each_parameter_at_its_own_rank():
    """A PEFT 3D adapter with rank_pattern on one expert parameter (down_proj r 4 beside gate_up at r 16, 8 experts:
    lora_A rows 128 and 32) is read as 8 experts, whichever lora_A comes first; one pattern applied to both read 32."""
    from lpdiff.harness.spec.adapters.inspection import peft3d_expert_count

    pre = "base_model.model.model.layers.0.mlp.experts"
    keys = [f"{pre}.base_layer.lora_A.weight", f"{pre}.lora_A.weight"]
    cfg = {"r": 16, "rank_pattern": {"experts.down_proj": 4}}
    for rows in ((128, 32), (32, 128)):
        shapes = {k: (n, 40) for k, n in zip(keys, rows)}
        assert peft3d_expert_count(keys, shapes, cfg, 16) == 8
    assert peft3d_expert_count(keys[:1], {keys[0]: (128, 40)}, {"r": 16}, 16) == 8
    assert peft3d_expert_count(keys[:1], {keys[0]: (100, 40)}, {"r": 16}, 16) is None  # no rank fits: not guessed
