"""lpdiff bisect inside the hybrids' mixers (harness/commands/bisect_steps.py): every sub-step of a Mamba-2 and a
Gated DeltaNet mixer captured in HF (engines/hf_steps.py) and in the triton runtime, the clean runtime within fp32
rounding at each, and a defect at one step named there, not at a step before it.

Each step is shown localisable by a real defect of that step's own weights: one weight of the runtime's layer 0
moved in place on the open engine (HF keeps the checkpoint's), so the steps before it must stay at rounding and the
step itself must be named. The delta rule / SSD scan have no weights of their own: the state_not_reset fault names
them (here and, with every other hybrid fault, in suites/test_bug_zoo.py)."""

from __future__ import annotations

import pytest
import torch

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.harness.commands import bisect as bs
from lpdiff.harness.commands.bisect_steps import STEP_SHARE, STEPS, first_step, step_errors
from lpdiff.harness.spec.resolve import resolve

LIMIT = 1e-5  # 10 x the module noise floor of the tiny zoo (3.6-4.6e-7, commands/bisect.py reference_floor)
CLEAN = 2e-6  # the clean runtime's worst step: 6.7e-7 (Qwen3.5's delta rule), 2.2e-7 (Nemotron's SSD scan)


def _nemotron(m, name):
    """Layer 0's Mamba-2 weights of the runtime's model -> the tensor ``name`` names."""
    lay = m.w.layers[0]
    return {"in_proj": lay.mods["in_proj"].w, "out_proj": lay.mods["out_proj"].w, **lay.p}[name]


def _qwen35(m, name):
    """Layer 0's Gated DeltaNet weights; in_proj_{qkv,z,b,a} are row blocks of the fused in projection."""
    lw = m.w.layers[0]
    if name.startswith("in_proj_"):
        w, bounds = lw.proj_in.w, lw.proj_in.offsets  # (0, qkv, +z, +b, +a)
        j = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a").index(name)
        return w[bounds[j] : bounds[j + 1]]
    return {"conv1d": lw.conv, "A_log": lw.A_log, "dt_bias": lw.dt_bias, "gnorm": lw.gnorm, "out_proj": lw.proj_out.w}[
        name
    ]


# (model, the runtime's weight moved, the step bisect must name)
CASES = {
    "tiny-nemotron-h": (
        _nemotron,
        [
            ("in_proj", "in_proj"),
            ("conv_w", "conv1d"),
            ("conv_b", "conv1d"),
            ("A", "ssd_scan"),
            ("dt_bias", "ssd_scan"),
            ("D", "d_skip"),
            ("gate_norm", "gated_norm"),
            ("out_proj", "out_proj"),
        ],
    ),
    "tiny-qwen3.5-moe": (
        _qwen35,
        [
            ("in_proj_qkv", "in_proj_qkv"),
            ("in_proj_z", "in_proj_z"),
            ("in_proj_b", "in_proj_b"),
            ("in_proj_a", "in_proj_a"),
            ("conv1d", "conv1d"),
            ("A_log", "gate"),
            ("dt_bias", "gate"),
            ("gnorm", "gated_norm"),
            ("out_proj", "out_proj"),
        ],
    ),
}
KIND = {"tiny-nemotron-h": "mamba", "tiny-qwen3.5-moe": "linear_attention"}


@pytest.mark.parametrize("model", list(CASES))
def test_each_mixer_step_named_where_its_weight_moved(model):
    """One HF capture with layer 0's steps; one open runtime, each case's weight moved and put back between
    captures. Clean: every step (base and adapter delta) within fp32 rounding, so no step is named."""
    r = resolve(model, ["all"])
    prompts = bs.equal_length(r.prompts, 2)
    ref = bs.hf_captures(r.spec, r.adapters, ["all"], prompts, steps=[0])["all"]
    inputs = {k: v for k, v in ref.items() if k[1].endswith(bs.INPUTS)}
    weight, cases = CASES[model]
    kind = KIND[model]
    rows, n = [*prompts], len(prompts) * len(prompts[0])
    cfg = EngineConfig(model=r.spec, adapters=dict(r.adapters), tp=1)
    with open_engine("triton", cfg) as eng:
        m = eng.runtime.model

        def errors():
            got = eng.capture_layers(rows, ["all"] * len(rows), inputs=inputs, steps=[0])
            return step_errors({k: v[:n] for k, v in got.items()}, ref, 0, kind)

        clean = errors()
        assert list(clean) == [s + lora for s in STEPS[kind] for lora in ("", "_lora")]
        assert max(clean.values()) < CLEAN, clean
        assert first_step(clean, kind, False, LIMIT) is None and first_step(clean, kind, True, LIMIT) is None
        g = torch.Generator().manual_seed(7)
        for name, want in cases:
            w = weight(m, name)
            kept = w.clone()
            w.add_(0.05 * w.abs().mean() * torch.randn(w.shape, generator=g).to(w))
            try:
                err = errors()
            finally:
                w.copy_(kept)
            found = first_step(err, kind, False, LIMIT)
            assert found is not None and found[0] == want, (name, found, err)
            assert found[1] > 100 * LIMIT, (name, found)
            # bisect's own limit also asks STEP_SHARE of the module's error (the mixer's output: its out_proj step)
            assert first_step(err, kind, False, max(LIMIT, STEP_SHARE * err["out_proj"])) == found, (name, err)
        assert errors() == clean  # every weight back in place


def test_cli_names_the_mixer_and_its_step(capsys):
    """The whole path (commands/bisect.py bisect: module comparison, then drill at TP 1): Qwen3.5's linear-attention
    LoRA dropped is named in layer 0's linear_attention_lora and, inside, at the first projection of its delta."""
    from lpdiff.harness.cli import main

    args = ["bisect", "tiny-qwen3.5-moe", "--adapter", "all", "--num-prompts", "2", "--tp", "1"]
    assert main([*args, "--fault", "linear_attention_lora_dropped"]) == 1
    out = capsys.readouterr().out
    assert "first above noise: layer 0 linear_attention_lora of all" in out, out
    assert "; inside it first in_proj_qkv (error " in out, out
    assert "layer 0 linear_attention_lora of all, step by step (TP 1): in_proj_qkv " in out, out
