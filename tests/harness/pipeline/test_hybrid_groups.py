"""Adapters per module group on the hybrids (Qwen3.5: gated full attention + Gated DeltaNet; Nemotron-H: Mamba-2 +
attention + MoE with a shared expert), checked against PEFT itself on the tiny zoo checkpoints: each group alone
and all together touch exactly their modules and the canonical form reproduces PEFT's merge_and_unload; the expert
group's per-expert and shared-outer layouts are exact; per-group delta fidelity names the group a lane lost."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lpdiff.harness.spec import adapters as ad
from lpdiff.harness.spec import mutations
from tests.helpers.adapters import ATOL, changed, max_diff, peft_merged, per_expert_merged

GROUPS = {
    "tiny-qwen3.5-moe": ["attention", "linear_attention", "shared_expert", "experts"],
    "tiny-nemotron-h": ["attention", "mamba", "mlp", "shared_expert", "experts"],
}
ARCH = {"tiny-qwen3.5-moe": "qwen3_5_moe_text", "tiny-nemotron-h": "nemotron_h"}
# The leaves each group must reach (the list, written out so the check does not reuse module_group)
LEAVES = {
    "attention": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "linear_attention": {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"},
    "mamba": {"in_proj"},  # PEFT 0.21 refuses out_proj on nemotron_h (test_peft_refuses_mamba_out_proj)
    "mlp": {"up_proj", "down_proj"},
    "shared_expert": {"gate_proj", "up_proj", "down_proj"},
    "experts": {"gate_up_proj", "up_proj", "down_proj"},
}
CASES = [(m, g) for m, gs in GROUPS.items() for g in [*gs, "all"]]
_MODELS: dict[str, torch.nn.Module] = {}


def zoo_model(name: str) -> torch.nn.Module:
    from lpdiff.harness.spec.catalog import get_model, load_hf_model

    if name not in _MODELS:
        _MODELS[name] = load_hf_model(get_model(name), torch.float32, "cpu").eval()
    return _MODELS[name]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    out = {}
    for model, group in CASES:
        groups = GROUPS[model] if group == "all" else [group]
        out[model, group] = Path(
            ad.generate_adapter(zoo_model(model), root / model / group, groups, rank=4, alpha=8, seed=3).path
        )
    return out


@pytest.mark.parametrize("model,group", CASES, ids=[f"{m}-{g}" for m, g in CASES])
def test_group_alone_matches_peft_merge_and_touches_only_its_modules(model, group, generated):
    m = zoo_model(model)
    path = generated[model, group]
    canon = ad.load_canonical(path, m.config)
    merged = peft_merged(m, path)
    assert max_diff(ad.merge_into(copy.deepcopy(m), canon).state_dict(), merged) <= ATOL
    touched = changed(merged, m)
    assert touched == {f"{n}.weight" for n in canon.dense} | set(canon.experts) and touched
    want = set(GROUPS[model]) if group == "all" else {group}
    assert {ad.module_group(k.removesuffix(".weight")) for k in touched} == want
    leaves = {k.removesuffix(".weight").rsplit(".", 1)[-1] for k in touched}
    assert leaves <= set().union(*(LEAVES[g] for g in want))
    if group != "all":  # every module of the group in every layer that has one
        expected = {
            n
            for n in ad.ModelLayout.of(m).linears
            if ad.module_group(n) == group and n.rsplit(".", 1)[-1] in LEAVES[group]
        }
        expected |= {n for n in ad.ModelLayout.of(m).experts if group == "experts"}
        assert {k.removesuffix(".weight") for k in touched} == expected
    assert ad.adapter_groups(path) == tuple(g for g in ad.GROUPS if g in want)


def test_qwen3_5_gated_q_lora_reaches_the_output_gate(generated):
    """Qwen3.5's q_proj is 2 x heads x head_dim wide: per head, head_dim query rows then head_dim output-gate rows.
    The attention adapter's delta covers both halves, and a LoRA on the gate rows alone moves the logprobs."""
    from peft import PeftModel
    from safetensors.torch import save_file

    m = zoo_model("tiny-qwen3.5-moe")
    cfg = m.config
    path = generated["tiny-qwen3.5-moe", "attention"]
    q = next(n for n in ad.load_canonical(path, cfg).dense if n.endswith("q_proj"))
    hd, nh = cfg.head_dim, cfg.num_attention_heads
    assert ad.ModelLayout.of(m).linears[q] == (2 * nh * hd, cfg.hidden_size)
    delta = ad.load_canonical(path, cfg).delta(q).view(nh, 2, hd, -1)
    assert (delta[:, 0].flatten(1).abs().sum(1) > 0).all()  # every head's query rows move
    assert (delta[:, 1].flatten(1).abs().sum(1) > 0).all()  # and every head's gate rows
    # gate rows only: zero the query half of q_proj's B, drop every other module's B
    tensors = load_file(path / ad.WEIGHTS_NAME)
    gate_only = path.parent / "gate_only"
    gate_only.mkdir(exist_ok=True)
    for k, t in tensors.items():
        if k.endswith("lora_B.weight"):
            t = t.clone()
            if ".q_proj." in k:
                t.view(nh, 2, hd, -1)[:, 0] = 0
            else:
                t.zero_()
            tensors[k] = t
    save_file(tensors, str(gate_only / ad.WEIGHTS_NAME), metadata={"format": "pt"})
    (gate_only / ad.CONFIG_NAME).write_text((path / ad.CONFIG_NAME).read_text())
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 41, 8, 600, 12, 9, 33]])

    def run(model):  # logprobs, and the query states entering q_norm (the rows left of the gate)
        seen = []
        attn = next(mod for n, mod in model.named_modules() if n.endswith("self_attn"))
        h = attn.q_norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].clone()))
        try:
            with torch.no_grad():
                return model(ids).logits.log_softmax(-1), seen[0]
        finally:
            h.remove()

    base, q_base = run(m)
    lora, q_lora = run(PeftModel.from_pretrained(copy.deepcopy(m), str(gate_only)).eval())
    assert torch.equal(q_lora, q_base)  # the zeroed rows are exactly the query rows...
    assert (lora - base).abs().max() > 1e-3  # ...and the gate rows' LoRA moves the output


def test_peft_refuses_mamba_out_proj_and_in_proj_covers_every_slice(generated):
    """What works for Mamba LoRA under PEFT 0.21: in_proj (all its rows: z, x, B, C, dt), not out_proj or conv1d."""
    from peft import LoraConfig, get_peft_model

    m = zoo_model("tiny-nemotron-h")
    with pytest.raises(ValueError, match="incompatible with Mamba"):
        get_peft_model(copy.deepcopy(m), LoraConfig(r=2, target_modules=["out_proj"]))
    with pytest.raises(ValueError, match="PEFT refuses"):
        ad.generate_adapter(m, generated["tiny-nemotron-h", "mamba"].parent / "x", ["mixer.out_proj"])
    canon = ad.load_canonical(generated["tiny-nemotron-h", "mamba"], m.config)
    for name in canon.dense:
        rows = canon.delta(name).abs().sum(1)
        assert name.endswith("mixer.in_proj") and (rows > 0).all(), name  # no slice of in_proj left out


@pytest.mark.parametrize("model", list(GROUPS))
def test_expert_layouts_are_exact(model, generated, tmp_path):
    """peft3d -> per_expert -> peft3d is bit-exact, the per-expert files read with HF's own row conventions equal
    PEFT's merge, and the shared-outer form (one up/gate_up A and one down B for all experts) equals PEFT's merge."""
    m = zoo_model(model)
    src = generated[model, "experts"]
    pe = ad.convert_adapter(src, tmp_path / "pe", "per_expert", m.config).path
    back = ad.convert_adapter(pe, tmp_path / "back", "peft3d", m.config).path
    s, d = load_file(f"{src}/adapter_model.safetensors"), load_file(f"{back}/adapter_model.safetensors")
    assert s.keys() == d.keys() and all(torch.equal(s[k], d[k]) for k in s)
    assert max_diff(per_expert_merged(m, tmp_path / "pe", ARCH[model]), peft_merged(m, src)) <= ATOL
    so = ad.generate_adapter(m, tmp_path / "so", ["experts"], rank=4, alpha=8, seed=5, shared_outer=True).path
    canon = ad.load_canonical(so, m.config)
    for name, (a, b) in canon.experts.items():
        shared = b if name.endswith("down_proj") else a
        assert all(torch.equal(shared[e], shared[0]) for e in range(shared.shape[0])), name
    assert max_diff(ad.merge_into(copy.deepcopy(m), canon).state_dict(), peft_merged(m, so)) <= ATOL


@pytest.mark.parametrize(
    "model,group",
    [("tiny-qwen3.5-moe", "linear_attention"), ("tiny-nemotron-h", "mamba"), ("tiny-nemotron-h", "shared_expert")],
)
def test_drop_group_zeroes_exactly_that_group(model, group, generated, tmp_path):
    m = zoo_model(model)
    src = generated[model, "all"]
    dropped = mutations.drop_group(src, tmp_path / "d", group)
    good, bad = peft_merged(m, src), peft_merged(m, dropped)
    base = m.state_dict()
    for k in changed(good, m):
        mine = ad.module_group(k.removesuffix(".weight")) == group
        assert torch.equal(bad[k], base[k]) if mine else torch.equal(bad[k], good[k]), k
    with pytest.raises(ValueError, match="has no mlp LoRA"):
        mutations.drop_group(generated[model, "attention"], tmp_path / "x", "mlp")


# -- per-group delta fidelity in the verdict ---------------------------------------------------------------------


def _run(values):
    from lpdiff.harness.types import LogprobRun, PromptLogprobs

    return LogprobRun(
        [PromptLogprobs(token_ids=np.arange(len(values) + 1), logprobs=np.asarray(values, dtype=np.float64))]
    )


def test_lane_fidelity_names_the_dropped_group():
    """A lane per group plus an all-groups lane: the engine drops the shared expert everywhere. The group's own lane
    and the all-groups lane both report it under its name; the intact group stays within the threshold."""
    from lpdiff.harness.pipeline.metrics import compare, lane_fidelity
    from lpdiff.harness.pipeline.thresholds import Threshold
    from lpdiff.harness.pipeline.verdict import judge

    base = [-1.0, -2.0, -3.0]
    refs = {
        None: _run(base),
        "attention": _run([-1.1, -2.0, -3.0]),
        "shared_expert": _run([-1.0, -2.2, -3.0]),
        "all": _run([-1.1, -2.2, -3.1]),
    }
    runs = dict(refs, shared_expert=_run(base), all=_run([-1.1, -2.0, -3.1]))  # shared-expert LoRA dropped
    groups = {
        "attention": ("attention",),
        "shared_expert": ("shared_expert",),
        "all": ("attention", "shared_expert", "experts"),
    }
    fid = lane_fidelity(runs, refs, groups)
    assert fid["attention"] == {"attention": 0.0} and fid["shared_expert"] == {"shared_expert": 1.0}
    assert set(fid["all"]) == {"adapter", "attention", "shared_expert"} and fid["all"]["shared_expert"] == 1.0
    thr = Threshold(k2=1e-8, max_abs=1e-3, delta_fidelity=0.01, source="unmeasured")
    v = judge(compare(runs["all"], refs["all"]), thr, delta_fidelity=fid["all"])
    assert not v.passed and any(r.startswith("delta fidelity [shared_expert] 1 >") for r in v.reasons)
    assert not any("[attention]" in r for r in v.reasons)
    assert lane_fidelity(runs, refs, {})["all"] == pytest.approx(fid["all"]["adapter"])  # no groups: one number
