"""Bug zoo for the hybrids on the tiny zoo (CPU, HF engine): faults an engine commits on Qwen3.5 and Nemotron-H,
each fed through the default verdict path (stored HF fp32 references, thresholds.json) and required to FAIL.

- a module group's LoRA dropped (shared expert, linear attention, mamba): the engine gets adapters whose group's
  LoRA-B is zero (mutations.drop_group), as an engine that has no LoRA path for those modules computes; the lanes
  holding that group FAIL with "delta fidelity [<group>]", the others PASS.
- Nemotron's router correction bias rounded before top-k: NemotronHTopkRouter's forward patched for the duration of
  the run (``router_bias_rounded``), standing in for an engine fault switch, which the HF engine does not have; the
  base lane FAILs with every adapter lane, which places the fault outside the LoRA groups.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from lpdiff.harness.commands.run import Job, judge_runs, references, resolve_job
from lpdiff.harness.pipeline.session import run_session
from lpdiff.harness.spec.adapters import adapter_groups
from lpdiff.harness.spec.mutations import drop_group
from lpdiff.harness.types import AdapterSpec

DROPS = [
    ("tiny-qwen3.5-moe", "shared_expert"),
    ("tiny-nemotron-h", "shared_expert"),
    ("tiny-qwen3.5-moe", "linear_attention"),
    ("tiny-nemotron-h", "mamba"),
]


def _session(job: Job, adapters: dict[str, AdapterSpec], store, regen: bool):
    spec, zoo, prompts = resolve_job(job)
    refs = references(job, store, regen).runs(spec, zoo, prompts)
    runs = run_session(job.engine, spec, adapters, prompts, job.dtype, job.tp, job.top_k).first
    return judge_runs(job, runs, refs)


def _record(verdicts, fault, record_verdict):
    for v in verdicts:
        if not v.passed:
            v.adapter, v.expected = f"{v.adapter} [fault {fault}]", "FAIL"
        record_verdict(v)


@pytest.mark.cpu
@pytest.mark.parametrize("model,group", DROPS, ids=[f"{g}-{m}" for m, g in DROPS])
def test_dropped_group_fails_and_is_named(model, group, tmp_path, lpdiff_store, lpdiff_regen, record_verdict):
    # the group's own adapter, the adapter with every group, and one without the group (must stay PASS)
    job = Job(model=model, adapters=(group, "all", "attention"))
    zoo = resolve_job(job).adapters
    broken = {
        a: AdapterSpec(a, str(drop_group(s.path, tmp_path / a, group))) if group in adapter_groups(s.path) else s
        for a, s in zoo.items()
    }
    verdicts = {v.adapter: v for v in _session(job, broken, lpdiff_store, lpdiff_regen)}
    _record(verdicts.values(), f"{group}_lora_dropped", record_verdict)
    for lane in (group, "all"):
        v = verdicts[lane]
        assert not v.passed, f"{model}: dropping {group} passed the {lane} lane: {v.reasons}"
        assert any(r.startswith(f"delta fidelity [{group}] ") for r in v.reasons), v.reasons
        assert not any(r.startswith("delta fidelity [attention]") for r in v.reasons), v.reasons
    assert verdicts["-"].passed and verdicts["attention"].passed, (verdicts["-"].reasons, verdicts["attention"].reasons)


@contextlib.contextmanager
def router_bias_rounded(decimals: int = 2):
    """Nemotron-H's e_score_correction_bias rounded to ``decimals`` before the top-k choice (routing weights keep
    the unbiased sigmoid scores, as HF computes them). Patches the transformers class for the duration: every
    Nemotron-H model in the process routes with the rounded bias, and the real bias is back in place before any
    forward hook (lpdiff's router-margin recorder) sees the module. Rounding to bf16 instead moves the tiny zoo's
    biases by at most 2.3e-4, far below its smallest routing margins (p1 0.09), so no choice changes and the output
    is bit-identical: nothing to catch there."""
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    real = nh.NemotronHTopkRouter.forward

    def forward(self, hidden_states):
        kept = self.e_score_correction_bias.clone()
        self.e_score_correction_bias.copy_(torch.round(kept, decimals=decimals))
        try:
            return real(self, hidden_states)
        finally:
            self.e_score_correction_bias.copy_(kept)

    nh.NemotronHTopkRouter.forward = forward
    try:
        yield
    finally:
        nh.NemotronHTopkRouter.forward = real


@pytest.mark.cpu
def test_router_bias_rounded_before_topk_fails(lpdiff_store, lpdiff_regen, record_verdict):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    real = NemotronHTopkRouter.forward
    job = Job(model="tiny-nemotron-h", adapters=("all", "experts"))
    zoo = resolve_job(job).adapters
    with router_bias_rounded(2):
        verdicts = _session(job, zoo, lpdiff_store, lpdiff_regen)
    _record(verdicts, "router_bias_rounded", record_verdict)
    failed = {v.adapter.split(" [")[0] for v in verdicts if not v.passed}
    assert failed >= {"-", "all"}, [(v.adapter, v.reasons) for v in verdicts]  # the base model itself moved
    base = next(v for v in verdicts if v.adapter.startswith("-"))
    assert any(r.startswith(("k2 ", "max |Δ| ")) for r in base.reasons), base.reasons
    assert NemotronHTopkRouter.forward is real  # scoped to the with block
