"""engines/hf_steps.py on the tiny zoo's Nemotron-H in transformers (CPU, fp32): while the tracer is active, one
Mamba-2 mixer's sub-steps are recorded as (tokens, width) under "mamba.<step>", the scan split into its D skip
(D * x, x read from the conv's outputs) and the rest, the out_proj step equal to the mixer's own output; leaving it
restores transformers' scan function and records nothing more."""

import importlib
import random

import pytest
import torch

from lpdiff.engines.hf_steps import _SEQUENCE_OPS, StepTracer
from lpdiff.harness.spec.catalog import get_model, load_hf_model


@pytest.fixture(scope="module")
def nemotron():
    model = load_hf_model(get_model("tiny-nemotron-h"), torch.float32, "cpu")
    layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mixer, "in_proj")]
    assert layers, "the tiny Nemotron-H has Mamba layers"
    return model, layers


def test_mamba_steps_are_recorded_and_add_up(nemotron):
    model, layers = nemotron
    i = random.choice(layers)
    mixer = model.model.layers[i].mixer
    T = random.randint(5, 17)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    outs = []
    handle = mixer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
    module, name = _SEQUENCE_OPS["mamba"]
    real = getattr(importlib.import_module(module), name)
    cap: dict = {}
    tracer = StepTracer({i: (mixer, "mamba")}, cap, tokens=T)
    tracer.suffix = "_base"
    try:
        with torch.no_grad(), tracer.active():
            model(ids)
    finally:
        handle.remove()
    steps = {k[1] for k in cap if k[0] == i}
    assert steps == {f"mamba.{s}_base" for s in ("in_proj", "out_proj", "gated_norm", "conv1d", "d_skip", "ssd_scan")}
    assert all(t.shape[0] == T for t in cap.values())
    torch.testing.assert_close(cap[i, "mamba.out_proj_base"], outs[0].reshape(T, -1))
    heads_x_dim = cap[i, "mamba.d_skip_base"].shape[1]
    x = cap[i, "mamba.conv1d_base"][:, :heads_x_dim].reshape(T, mixer.D.numel(), -1)
    torch.testing.assert_close(cap[i, "mamba.d_skip_base"], (mixer.D[:, None] * x).reshape(T, -1))
    assert getattr(importlib.import_module(module), name) is real  # the scan is transformers' own again
    cap.clear()
    with torch.no_grad():
        model(ids)
    assert cap == {}  # hooks removed with the context
