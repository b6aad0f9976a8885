"""lpdiff bisect names the module each zoo fault breaks — and a defect it was never told about — against a noise
floor from two correct HF implementations, and names nothing on the clean runtime."""

import pytest
import torch

from lpdiff.harness.commands import bisect as bs
from lpdiff.harness.spec.resolve import resolve
from lpdiff.kernels.faults import FAULTS, runtime_faults

MODELS = {"tiny-qwen3-moe": "qwen3_moe", "tiny-gpt-oss": "gpt_oss"}
CASES = [(f, m) for m, arch in MODELS.items() for f in runtime_faults(arch)]
EXPERTS = ["experts"]  # a batch of one adapter (every row runs it)


@pytest.fixture(scope="module")
def hf_side():
    """HF captures and the clean runtime's floors, once per model (the expensive, fault-independent part)."""
    cache = {}

    def get(model):
        if model not in cache:
            spec, adapters, prompts = resolve(model)
            prompts = bs.equal_length(prompts)
            hf = bs.hf_captures(spec, adapters, EXPERTS, prompts, {"experts_impl": "eager"})
            floors = bs.reference_floor(spec, adapters, EXPERTS, prompts, hf)
            clean = bs.triton_errors(spec, adapters, EXPERTS, prompts, hf, None)
            cache[model] = (spec, adapters, prompts, hf, floors, clean)
        return cache[model]

    return get


@pytest.mark.parametrize("model", list(MODELS))
def test_clean_runtime_names_nothing(model, hf_side):
    _, _, _, _, floors, clean = hf_side(model)
    assert bs.first_above(clean, floors, bs.FACTOR) is None
    # the floor is fp32 rounding, not a tolerance wide enough to hide a bug
    assert max(floors.values()) < 1e-5, floors


@pytest.mark.parametrize("fault,model", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_names_the_broken_module(fault, model, hf_side):
    spec, adapters, prompts, hf, floors, _ = hf_side(model)
    errors = bs.triton_errors(spec, adapters, EXPERTS, prompts, hf, fault)
    found = bs.first_above(errors, floors, bs.FACTOR)
    assert found is not None, f"{fault}: nothing above noise"
    assert (found.adapter, found.layer, found.module) == ("experts", 0, FAULTS[fault].module_on(MODELS[model])), found
    assert found.ratio > 1e3  # far above noise, not a borderline call


@pytest.mark.parametrize("model", list(MODELS))
def test_names_a_defect_it_was_not_told_about(model, hf_side, monkeypatch):
    """Not a bug-zoo fault and no --fault: the runtime's attention output is off by 1e-4 relative in layer 1 only
    (a mis-scaled shard, a wrong softmax scale...). bisect must name layer 1 attention, with floors taken from HF's
    two expert kernels, not from the broken runtime."""
    from lpdiff.engines.triton import model as triton_model

    spec, adapters, prompts, hf, floors, _ = hf_side(model)
    real = triton_model.MoeTransformer.attend
    layer_of = {}

    def attend(self, h, lw, ll, batch, window):
        out = real(self, h, lw, ll, batch, window)
        i = layer_of.setdefault(id(lw), next(k for k, w in enumerate(self.w.layers) if w is lw))
        return out * (1 + 1e-4) if i == 1 else out

    monkeypatch.setattr(triton_model.MoeTransformer, "attend", attend)
    errors = bs.triton_errors(spec, adapters, EXPERTS, prompts, hf, None)
    found = bs.first_above(errors, floors, bs.FACTOR)
    assert found is not None and (found.layer, found.module) == (1, "attention"), found
    assert torch.isfinite(torch.tensor(found.ratio)) and found.ratio > 10 * bs.FACTOR


def test_first_above_order_and_nan():
    """Earlier layers win; inside a layer the data-flow order does (a module on the base weights before its adapter
    delta, the mixer before the MoE), then the batch's adapter order; a NaN error is above any floor."""
    floors = dict.fromkeys(bs.MODULES, 1e-06)
    errs = {(c, i, m): 0.0 for c in (None, "a", "b") for i in range(3) for m in bs.MODULES}
    errs[None, 2, "attention"] = 1.0
    errs["b", 1, "experts"] = errs["a", 1, "expert_lora"] = errs["a", 1, "shared_expert"] = 1.0
    where = lambda f: (f.adapter, f.layer, f.module)  # noqa: E731
    assert where(bs.first_above(errs, floors, 10)) == ("b", 1, "experts")
    errs["a", 1, "experts"] = 1.0
    assert where(bs.first_above(errs, floors, 10)) == ("a", 1, "experts")
    errs["b", 1, "mamba_lora"] = 1.0
    assert where(bs.first_above(errs, floors, 10)) == ("b", 1, "mamba_lora")
    errs["b", 0, "hidden"] = float("nan")
    assert where(bs.first_above(errs, floors, 10)) == ("b", 0, "hidden")


def test_cli_bisect_reports_and_exit_code(capsys):
    from lpdiff.harness.cli import main

    assert (
        main(
            [
                "bisect",
                "tiny-gpt-oss",
                "--fault",
                "topk_weight_missing",
                "--num-prompts",
                "2",
                "--adapter",
                "experts",
                "--tp",
                "1",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "layer 0 expert_lora of experts" in out and "noise" in out
    assert main(["bisect", "tiny-gpt-oss", "--fault", "no_such_fault"]) == 2  # bad input: exit 2, no traceback
    assert "invalid choice: 'no_such_fault'" in capsys.readouterr().err


def test_hf_capture_refuses_an_adapter_per_prompt():
    """HF, the reference, captures one adapter for the whole batch (bisect captures it once per adapter): a list
    of per-prompt choices is one clear error, not a TypeError deep in its adapter context."""
    from lpdiff.engines import EngineConfig, open_engine
    from lpdiff.harness.spec.resolve import resolve

    r = resolve("tiny-qwen3-moe", adapters=("experts",))
    with (
        open_engine("hf", EngineConfig(model=r.spec, adapters=r.adapters)) as eng,
        pytest.raises(ValueError, match=r"one adapter .* for the whole batch"),
    ):
        eng.capture_layers([[1, 2, 3], [4, 5, 6]], ["experts", None])
