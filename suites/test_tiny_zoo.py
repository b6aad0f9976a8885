"""CPU suite on the embedded tiny MoE models: engines judged against the committed HF+PEFT fp32 baselines.

Each verdict lands in the table the plugin prints at the end of the run. Thresholds come from
harness/thresholds.json with their provenance (measured noise floor, date, machine).
"""

import pytest

from lpdiff.harness.commands.run import Job, default_tps, run_job
from lpdiff.harness.pipeline.thresholds import lookup

TINY_MOE = ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-qwen3.5-moe", "tiny-nemotron-h"]
# the Triton runtime covers these architectures (engines/triton)
TRITON_ARCHS = ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-qwen3.5-moe", "tiny-nemotron-h"]


def _judge(job, store, regen, record_verdict):
    res = run_job(job, store, regen=regen)
    for v in res.verdicts:
        record_verdict(v)
    failed = [f"{v.adapter}: {'; '.join(v.reasons)}" for v in res.verdicts if not v.passed]
    assert not failed, f"{job.model} {job.engine_pair}: " + " | ".join(failed)
    return res


@pytest.mark.cpu
@pytest.mark.parametrize("model", TINY_MOE)
def test_hf_matches_committed_baseline(model, lpdiff_store, lpdiff_regen, record_verdict):
    """The reference engine reproduces its own committed fp32 runs (base and every adapter), including the
    LoRA-delta fidelity against the stored delta."""
    _judge(Job(model=model), lpdiff_store, lpdiff_regen, record_verdict)


@pytest.mark.cpu
@pytest.mark.parametrize("model", TINY_MOE)
def test_adapter_moves_output_far_above_threshold(model, lpdiff_store, lpdiff_regen):
    """An adapter that did nothing would pass every engine comparison; each zoo adapter must move the
    logprobs by at least 10x the threshold a verdict uses, or the suite could not see it dropped."""
    from lpdiff.harness.pipeline.metrics import compare

    res = run_job(Job(model=model), lpdiff_store, regen=lpdiff_regen)
    # fp32 is where LoRA correctness is judged (bf16 noise on these models is reported, not relied on)
    thr = lookup(model, Job(model=model).engine_pair, "float32", 1)
    for name, run in res.refs.items():
        if name is None:
            continue
        effect = compare(run, res.refs[None])
        assert effect.k2 >= 10 * thr.k2, f"{model}/{name}: LoRA effect k2 {effect.k2:.3g} < 10 x {thr.k2:.3g}"


@pytest.mark.cpu
@pytest.mark.parametrize("model", TINY_MOE)
def test_hf_bf16_vs_fp32_within_noise_threshold(model, lpdiff_store, lpdiff_regen, record_verdict):
    """bf16 against the fp32 reference, within thresholds set from the measured bf16 noise floor."""
    _judge(Job(model=model, dtype="bfloat16"), lpdiff_store, lpdiff_regen, record_verdict)


@pytest.mark.cpu
@pytest.mark.parametrize("tp", [pytest.param(t, id=f"tp{t}") for t in default_tps("triton")])
@pytest.mark.parametrize("model", TRITON_ARCHS)
def test_triton_fp32_matches_hf_baseline(model, tp, lpdiff_store, lpdiff_regen, record_verdict):
    """Our runtime (on the kernels' torch references or the Triton interpreter) against the HF baselines, at each
    TP size ``lpdiff run --engine triton`` covers by default (TP 2 on CPU: two gloo ranks), every zoo adapter in
    one mixed batch. The references are TP 1 HF runs: a reference never shards."""
    pytest.importorskip("lpdiff.engines.triton")
    _judge(Job(model=model, engine="triton", tp=tp), lpdiff_store, lpdiff_regen, record_verdict)
