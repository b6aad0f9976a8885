"""Bug zoo: the default triton-vs-HF-baseline job (suites/test_tiny_zoo.py) run with each named fault of
kernels/faults.py must FAIL, and each caught fault names the metric that caught it; the clean runtime must
pass 20 reruns without a false alarm. Faults are real engine bugs re-created at the spot where they lived."""

import numpy as np
import pytest

from lpdiff.harness.commands.run import Job, judge_runs, resolve_job, run_job
from lpdiff.harness.pipeline.session import mixed_batch
from lpdiff.kernels.faults import applicable, runtime_faults

MODELS = {
    "tiny-qwen3-moe": "qwen3_moe",
    "tiny-gpt-oss": "gpt_oss",
    "tiny-nemotron-h": "nemotron_h",
    "tiny-qwen3.5-moe": "qwen3_5_moe",
}

ZOO = [
    # slot of a rank-4 adapter among rank-8 ones copied flat (SGLang/vLLM max-rank padding bugs)
    ("lora_rank_layout", "tiny-qwen3-moe"),
    ("lora_rank_layout", "tiny-gpt-oss"),
    # gpt-oss interleaved gate/up LoRA-B rows read as gate-then-up (vLLM gpt-oss LoRA w13 layout)
    ("gpt_oss_gate_up_concat", "tiny-gpt-oss"),
    # torch.empty LoRA buffers: garbage in modules an adapter does not target
    ("lora_uninitialised", "tiny-qwen3-moe"),
    ("lora_uninitialised", "tiny-gpt-oss"),
    # LoRA-B expand without a column mask; the expert width 40 is not a multiple of the 32-column tile
    ("lora_b_unmasked", "tiny-qwen3-moe"),
    ("lora_b_unmasked", "tiny-gpt-oss"),
    # gate_up LoRA added after the activation (SiLU-gated on Qwen, clamped SwiGLU on gpt-oss)
    ("lora_after_activation", "tiny-qwen3-moe"),
    ("lora_after_activation", "tiny-gpt-oss"),
    # routing weight applied twice / not at all to the expert LoRA delta
    ("topk_weight_twice", "tiny-qwen3-moe"),
    ("topk_weight_twice", "tiny-gpt-oss"),
    ("topk_weight_missing", "tiny-qwen3-moe"),
    ("topk_weight_missing", "tiny-gpt-oss"),
    # PEFT 3D expert adapter skipped on load: output equals the base model on the experts (vLLM #41384)
    ("expert_adapter_dropped", "tiny-qwen3-moe"),
    ("expert_adapter_dropped", "tiny-gpt-oss"),
    # Nemotron-H's own: non-gated relu² experts run as gated, mamba LoRA never applied, router correction bias
    # rounded before the choice, scan state / conv window crossing prompts of a packed batch, shared expert lost
    ("relu2_as_gated", "tiny-nemotron-h"),
    ("mamba_lora_dropped", "tiny-nemotron-h"),
    ("router_bias_rounded", "tiny-nemotron-h"),
    ("state_not_reset", "tiny-nemotron-h"),
    ("conv_across_prompts", "tiny-nemotron-h"),
    ("shared_expert_dropped", "tiny-nemotron-h"),
    # Qwen3.5's own: linear-attention LoRA never applied, delta-rule state / conv window crossing prompts, shared
    # expert lost
    ("linear_attention_lora_dropped", "tiny-qwen3.5-moe"),
    ("state_not_reset", "tiny-qwen3.5-moe"),
    ("conv_across_prompts", "tiny-qwen3.5-moe"),
    ("shared_expert_dropped", "tiny-qwen3.5-moe"),
]


def caught_by(verdict) -> list[str]:
    """Metric names in the verdict's failure reasons: k2, max |Δ|, delta fidelity, NaN."""
    out = [m for m in ("k2", "max |Δ|", "delta fidelity") if any(r.startswith(m + " ") for r in verdict.reasons)]
    return out + ["NaN/inf"] * any("NaN" in r for r in verdict.reasons)


def test_zoo_covers_every_runtime_fault():
    """A new fault must get a case here (and the cases must name real faults on archs that have the bug)."""
    assert {f for f, _ in ZOO} == set(runtime_faults())
    assert all(applicable(f, MODELS[m]) for f, m in ZOO)


@pytest.mark.cpu
@pytest.mark.parametrize("fault,model", ZOO, ids=[f"{f}-{m}" for f, m in ZOO])
def test_default_suite_fails_on_fault(fault, model, lpdiff_store, lpdiff_regen, record_verdict):
    pytest.importorskip("lpdiff.engines.triton")
    res = run_job(Job(model=model, engine="triton", options={"fault": fault}), lpdiff_store, regen=lpdiff_regen)
    failed = [v for v in res.verdicts if not v.passed]
    for v in failed or res.verdicts:  # the lanes that caught the fault; every lane when none did
        v.adapter, v.expected = f"{v.adapter} [fault {fault}]", "FAIL"
        record_verdict(v)
    assert failed, f"{fault} on {model} passed every verdict: " + "; ".join(
        f"{v.adapter}: k2 {v.metrics.k2:.3g}" for v in res.verdicts
    )
    for v in failed:
        assert caught_by(v), f"{v.adapter} failed without a named metric: {v.reasons}"
    print(f"{fault} on {model} caught by: " + "; ".join(f"{v.adapter}: {', '.join(caught_by(v))}" for v in failed))


# lpdiff bisect on each hybrid fault (the qwen3_moe / gpt_oss faults: tests/harness/commands/test_bisect.py): the
# layer where it first shows (Qwen3.5: layers 0-2 Gated DeltaNet, 3 attention, a MoE in each; Nemotron-H: ME*ME-).
# The rounded router bias changes no choice in layer 1 on these prompts; layer 4 is the first where it picks another
# expert
BISECT_LAYER = {
    ("relu2_as_gated", "tiny-nemotron-h"): 1,
    ("router_bias_rounded", "tiny-nemotron-h"): 4,
    ("shared_expert_dropped", "tiny-nemotron-h"): 1,
}
# and inside a named mixer, the first of its sub-steps (harness/commands/bisect_steps.py STEPS) that leaves HF; a fault
# outside the Mamba-2 / Gated DeltaNet mixers has no step
BISECT_STEP = {
    ("mamba_lora_dropped", "tiny-nemotron-h"): "in_proj",
    ("state_not_reset", "tiny-nemotron-h"): "ssd_scan",
    ("conv_across_prompts", "tiny-nemotron-h"): "conv1d",
    ("linear_attention_lora_dropped", "tiny-qwen3.5-moe"): "in_proj_qkv",
    ("state_not_reset", "tiny-qwen3.5-moe"): "delta_rule",
    ("conv_across_prompts", "tiny-qwen3.5-moe"): "conv1d",
}
HYBRID_ZOO = [(f, m) for f, m in ZOO if MODELS[m] in ("nemotron_h", "qwen3_5_moe")]


@pytest.fixture(scope="module")
def bisect_side():
    """HF captures (with every mixer's sub-steps) and floors per hybrid: the zoo's every-group adapter on 2 prompts
    (2 rows of the pack, so state or a conv window crossing a prompt boundary shows)."""
    from transformers import AutoConfig

    from lpdiff.harness.commands import bisect as bs
    from lpdiff.harness.spec.resolve import resolve

    cache = {}

    def get(model):
        if model not in cache:
            r = resolve(model, ["all"])
            prompts = bs.equal_length(r.prompts, 2)
            layers = range(AutoConfig.from_pretrained(r.spec.path).get_text_config().num_hidden_layers)
            hf = bs.hf_captures(r.spec, r.adapters, ["all"], prompts, {"experts_impl": "eager"}, steps=layers)
            cache[model] = (r, prompts, hf, bs.reference_floor(r.spec, r.adapters, ["all"], prompts, hf))
        return cache[model]

    return get


@pytest.mark.cpu
@pytest.mark.parametrize("fault,model", HYBRID_ZOO, ids=[f"{f}-{m}" for f, m in HYBRID_ZOO])
def test_bisect_names_hybrid_fault(fault, model, bisect_side):
    """Not told which module: bisect names the fault's own (kernels/faults.py Fault.module_on), far above noise, and
    inside a Mamba-2 / Gated DeltaNet mixer the sub-step where it lives."""
    from lpdiff.harness.commands import bisect as bs
    from lpdiff.harness.commands.bisect_steps import first_step, mixer_of, step_errors
    from lpdiff.kernels.faults import FAULTS

    r, prompts, hf, floors = bisect_side(model)
    layers = sorted({i for i, _ in hf["all"]})
    got = bs.triton_captures(r.spec, r.adapters, ["all"], prompts, hf, fault, 1, layers)["all"]
    found = bs.first_above({("all", *k): e for k, e in bs.module_errors(got, hf["all"]).items()}, floors, bs.FACTOR)
    want = ("all", BISECT_LAYER.get((fault, model), 0), FAULTS[fault].module_on(MODELS[model]))
    assert found is not None and (found.adapter, found.layer, found.module) == want, found
    assert found.ratio > 1e2, found
    kind = mixer_of(found.module)
    step = None
    if kind is not None:
        errors = step_errors(got, hf["all"], found.layer, kind)
        step = first_step(errors, kind, found.module.endswith("_lora"), bs.step_limit(found))[0]
    assert step == BISECT_STEP.get((fault, model)), (step, found)


# Nemotron-H's 20 reruns take ~200 s on the CI's 2 cores (its 7 lanes x 8 prompts on the torch references), over the
# suite's budget; its clean lanes are judged at TP 1 and 2 in suites/test_tiny_zoo.py
RERUN_MODELS = ["tiny-qwen3-moe", "tiny-gpt-oss"]


@pytest.mark.cpu
@pytest.mark.parametrize("model", RERUN_MODELS)
def test_clean_runtime_20_reruns_no_false_alarm(model, lpdiff_store, lpdiff_regen):
    """The clean runtime, rerun 20 times in one engine session, passes every verdict every time; reruns are
    bit-identical (the CPU path is deterministic), so any failure is a real alarm, not noise."""
    pytest.importorskip("lpdiff.engines.triton")
    from lpdiff.engines import EngineConfig, open_engine

    job = Job(model=model, engine="triton")
    first = run_job(job, lpdiff_store, regen=lpdiff_regen)  # refs (and regen if asked) through the normal path
    spec, adapters, prompts = resolve_job(job)
    choices = [None, *adapters]
    alarms, spread = [], 0.0
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters)) as eng:
        for i in range(20):
            runs = mixed_batch(eng, prompts, choices, job.top_k)
            alarms += [f"rerun {i} {v.adapter}: {v.reasons}" for v in judge_runs(job, runs, first.refs) if not v.passed]
            for c in choices:
                for p, q in zip(runs[c].prompts, first.runs[c].prompts):
                    spread = max(spread, float(np.abs(p.logprobs - q.logprobs).max()))
    assert not alarms, alarms
    assert all(v.passed for v in first.verdicts)
    assert spread == 0.0, f"reruns differ by up to {spread:.3g}"


# -- GPU: full-width models (4 layers of Qwen3-30B-A3B and gpt-oss-20b), fp32 against HF+PEFT fp32 -----------------


@pytest.mark.gpu1
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_default_check_fails_on_every_fault_full_width(model, tmp_path):
    """Each runtime fault, at full width, FAILs the fp32 check (harness/check.py: threshold = 10 x the HF
    grouped_mm-vs-eager noise measured in the run); the clean runtime passes. A fault whose code path this shape
    never reaches (output bit-identical to the clean run) is reported, not counted as caught."""
    import torch

    from lpdiff.harness.commands import check
    from lpdiff.harness.spec.catalog import get_model

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    arch = get_model(model).arch
    faults = runtime_faults(arch)
    case = check.build_case(model, 4, tmp_path, layouts=("peft3d",))
    clean, results = check.fault_sweep(case, faults, "float32")
    print("\n" + check.format_result(clean))
    assert clean.as_expected, check.format_result(clean)
    for fault, res in results.items():
        print(
            f"{fault}: "
            + (
                "not reached at this shape"
                if res is None
                else "; ".join(
                    f"{v.adapter} {', '.join(caught_by(v))}"
                    for v in res.verdicts
                    if not v.passed and v.expected == "PASS"
                )
            )
        )
    escaped = [f for f, res in results.items() if res is not None and check.missed(res)]
    assert not escaped, f"faults that passed every correct lane on {model}: {escaped}"
    assert any(res is not None for res in results.values())
