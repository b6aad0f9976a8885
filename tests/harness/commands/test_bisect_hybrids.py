"""lpdiff bisect on the hybrids (Qwen3.5's Gated DeltaNet + gated attention + shared-expert MoE; Nemotron-H's Mamba-2,
attention, dense MLP and relu² MoE layers): both engines capture each layer's modules by kind, the clean runtime is
named nowhere in a default batch (base rows beside every zoo adapter), and a fault is named at the module it lives
in without being told which. One fault per arch here; every hybrid fault has its case in suites/test_bug_zoo.py."""

import pytest

from lpdiff.harness.commands import bisect as bs
from lpdiff.harness.spec.resolve import resolve
from lpdiff.kernels.faults import FAULTS

# (model, arch, fault, where bisect must name it: adapter, layer, module). Qwen3.5's layers 0-2 are Gated DeltaNet,
# layer 3 attention; Nemotron-H's pattern ME*ME-. A LoRA-only fault shows first in the "all" adapter's rows (the
# zoo's first adapter holding every group); state carried across prompts first in the second row of the pack
MODELS = [
    ("tiny-qwen3.5-moe", "qwen3_5_moe", "linear_attention_lora_dropped", ("all", 0, "linear_attention_lora")),
    ("tiny-nemotron-h", "nemotron_h", "state_not_reset", ("all", 0, "mamba")),
]


@pytest.fixture(scope="module")
def hf_side():
    """HF captures and floors for a default bisect's batch (base rows and every zoo adapter), 1 prompt per row."""
    cache = {}

    def get(model):
        if model not in cache:
            r = resolve(model)
            choices = bs.batch_choices(list(r.adapters))
            prompts = bs.equal_length(r.prompts, 1)
            hf = bs.hf_captures(r.spec, r.adapters, choices, prompts, {"experts_impl": "eager"})
            cache[model] = (r, choices, prompts, hf, bs.reference_floor(r.spec, r.adapters, choices, prompts, hf))
        return cache[model]

    return get


@pytest.mark.parametrize("model,arch,fault,where", MODELS, ids=[m for m, *_ in MODELS])
def test_hybrid_modules_captured_clean_and_fault_named(model, arch, fault, where, hf_side):
    r, choices, prompts, hf, floors = hf_side(model)
    kinds = {
        "tiny-qwen3.5-moe": ["linear_attention"] * 3 + ["attention"],
        "tiny-nemotron-h": ["mamba", "moe", "attention", "mamba", "moe", "mlp"],
    }[model]
    for i, kind in enumerate(kinds):  # each layer's modules by its kind, with the adapter and without
        names = (
            {"router_ids", "experts", "experts_base", "shared_expert", "shared_expert_base"}
            if kind == "moe"
            else {kind, f"{kind}_base", f"{kind}_in"}
        )
        if model == "tiny-qwen3.5-moe":
            names |= {"router_ids", "experts", "shared_expert", "shared_expert_base"}
        assert names <= {p for j, p in hf["all"] if j == i}, (i, kind)
    clean = bs.triton_errors(r.spec, r.adapters, choices, prompts, hf, None)
    assert bs.first_above(clean, floors, bs.FACTOR) is None
    assert max(floors.values()) < 1e-5, floors  # fp32 rounding, not a tolerance that hides a bug
    assert {m for _, _, m in clean} >= {
        "mamba_lora" if arch == "nemotron_h" else "linear_attention_lora",
        "attention_lora",
        "router",
        "expert_lora",
        "shared_expert_lora",
    }
    found = bs.first_above(bs.triton_errors(r.spec, r.adapters, choices, prompts, hf, fault), floors, bs.FACTOR)
    assert found is not None and (bs.label(found.adapter), found.layer, found.module) == where, found
    assert found.module == FAULTS[fault].module_on(arch) and found.ratio > 1e2


def test_cli_bisect_on_a_hybrid_names_the_fault_and_exits_1(capsys):
    """Plain bisect's batch (base rows and every zoo adapter) at TP 1, 1 prompt per row: Qwen3.5's shared expert
    dropped is named in layer 0's shared_expert of the base rows, exit 1; the verdict of a failing triton lane on a
    hybrid names that bisect as its next step."""
    from lpdiff.harness.cli import main
    from lpdiff.harness.pipeline.verdict import next_step

    model = "tiny-qwen3.5-moe"
    assert main(["bisect", model, "--num-prompts", "1", "--tp", "1", "--fault", "shared_expert_dropped"]) == 1
    out = capsys.readouterr().out
    assert "first above noise: layer 0 shared_expert of base" in out, out
    header = next(line for line in out.splitlines() if line.startswith("adapter"))
    assert {"linear_attention", "attention", "router", "shared_expert_lora"} <= set(header.split()), header
    assert bs.bisects(model) and bs.bisects("tiny-nemotron-h")
    assert (
        next_step("triton:float32-vs-hf:float32", model, "all", 2, ("all",), bisect=bs.bisects(model))
        == f"lpdiff bisect {model} --adapter all --tp 2"
    )
