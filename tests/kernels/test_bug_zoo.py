"""The bug zoo's faults at kernel level: each one really changes what the kernels compute (in the torch reference
and in the Triton kernel run by the interpreter), and only while it is active (relu2_as_gated on moe_forward
itself, as well as through the runtime's Nemotron-H experts). The runtime-level proof (default suite FAILs) is
suites/test_bug_zoo.py."""

import pytest
import torch

from lpdiff.kernels import faults, moe_forward
from tests.helpers.moe import NOISE, make_moe, rel_err

# expert width 40: not a multiple of the interpreter's 32-column tile, so the unmasked LoRA-B spills
SHAPE = dict(T=24, H=64, I=40, E=4, K=2)


def _out(params, impl, fault=None):
    with faults.injected(fault):
        return moe_forward(params, impl=impl)


@pytest.mark.parametrize(
    "fault,activation,same_in_both",
    [
        # the gate_up LoRA outside the activation: SiLU-gated (Qwen) and clamped SwiGLU (gpt-oss)
        ("lora_after_activation", "silu", True),
        ("lora_after_activation", "swiglu_oai", True),
        # routing weight on the down LoRA delta twice / never
        ("topk_weight_twice", "silu", True),
        ("topk_weight_missing", "swiglu_oai", True),
        # unmasked LoRA-B tile: both spill into the next row, but the kernel's rows are (gate, up)-interleaved
        # activations and the reference's are gate|up pre-activation, so only "wrong" is shared, not the values
        ("lora_b_unmasked", "silu", False),
    ],
)
def test_kernel_fault_changes_output_in_both_impls(fault, activation, same_in_both):
    p = make_moe(**SHAPE, activation=activation, ranks=(8, 4))
    clean_t, clean_k = _out(p, "torch"), _out(p, "triton")
    assert rel_err(clean_k, clean_t) < NOISE
    bad_t, bad_k = _out(p, "torch", fault), _out(p, "triton", fault)
    assert rel_err(bad_t, clean_t) > 1e3 * NOISE and rel_err(bad_k, clean_t) > 1e3 * NOISE
    if same_in_both:
        assert rel_err(bad_k, bad_t) < NOISE
    assert faults.active() is None
    assert torch.equal(_out(p, "torch"), clean_t)  # nothing lingers once the fault is gone


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_relu2_read_as_gated(impl):
    """Nemotron-H's non-gated relu^2 experts through a gated-only runner: caught at the MoE output (and the rows
    without an adapter are wrong too: the bug is in the base path)."""
    p = make_moe(**SHAPE, activation="relu2", ranks=(8,))
    clean = _out(p, "torch")
    assert rel_err(_out(p, impl), clean) < NOISE
    bad = _out(p, impl, "relu2_as_gated")
    assert rel_err(bad, clean) > 0.1
    none = p.token_adapter < 0
    assert rel_err(bad[none], clean[none]) > 0.1
    # gated activations are untouched by this fault
    q = make_moe(**SHAPE, activation="silu")
    assert torch.equal(_out(q, "torch", "relu2_as_gated"), _out(q, "torch"))


def test_fault_selection_is_explicit_and_scoped(monkeypatch):
    from lpdiff.engines import EngineConfig
    from lpdiff.engines.triton import TritonEngine
    from lpdiff.harness.spec.catalog import get_model

    spec = get_model("tiny-qwen3-moe")
    with pytest.raises(ValueError, match=r"unknown fault 'nope'.*lora_rank_layout"):
        TritonEngine(EngineConfig(model=spec, options={"fault": "nope"}))
    monkeypatch.setenv(faults.ENV, "lora_after_activation")
    eng = TritonEngine(EngineConfig(model=spec))
    assert eng.options.fault == "lora_after_activation"  # resolved once: TP workers get the same name
    monkeypatch.delenv(faults.ENV)
    assert TritonEngine(EngineConfig(model=spec)).options.fault is None
    with TritonEngine(EngineConfig(model=spec, options={"fault": "topk_weight_twice"})) as e:
        assert faults.active() == "topk_weight_twice" and "FAULT topk_weight_twice" in e.version()
    assert faults.active() is None


def test_every_fault_documents_its_real_bug():
    for f in faults.FAULTS.values():
        assert f.bug and f.where and f.module
        assert f.kernel_only == (not f.archs)
