"""vLLM's decode against an HF+PEFT prefill of the same sequences (fp32, the vLLM-CPU CI stage .ci/vllm_stage.sh;
skips where vLLM is not installed): a tiny dense Qwen3 with a LoRA adapter and base rows in one batch, greedy and
seeded sampling; vLLM's own logprob of each generated token (raw logprobs, its default) must equal the reference's
prefill logprob of that token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from lpdiff.engines.base import Decoding, EngineConfig, open_engine  # noqa: E402
from lpdiff.harness.types import AdapterSpec  # noqa: E402

TOL = 1e-4
N = 8


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import get_model, load_hf_model

    spec = get_model("tiny-qwen3-dense")
    if not (Path(spec.path) / "config.json").is_file():
        pytest.skip("the tiny dense zoo checkpoint is not built here")
    root = tmp_path_factory.mktemp("vllm-decode")
    model = load_hf_model(spec, torch.float32, "cpu")
    a = generate_adapter(model, root / "a8", groups=("attention", "mlp"), rank=8, alpha=16, seed=1)
    g = np.random.default_rng(0)
    prompts = [g.integers(1, model.config.vocab_size, size=n).tolist() for n in (9, 21, 14)]
    return spec, {"a8": AdapterSpec("a8", a.path)}, prompts


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_vllm_decode_logprobs_match_hf_prefill(dense, sampling):
    spec, adapters, prompts = dense
    choice = ["a8", None, "a8"]
    with open_engine("vllm", EngineConfig(spec, adapters, dtype="float32", device="cpu")) as eng:
        gens = eng.decode(prompts, choice, Decoding(N, sampling, 3))
    with open_engine("hf", EngineConfig(spec, adapters, dtype="float32", device="cpu")) as hf:
        ref = hf.prompt_logprobs([g.sequence for g in gens], choice)
        own = hf.decode(prompts, choice, Decoding(N)) if sampling == "greedy" else None
    for g, r in zip(gens, ref):
        assert len(g.tokens) == N and np.isfinite(g.logprobs).all()
        assert np.abs(g.logprobs - r.logprobs[-N:]).max() <= TOL, sampling
    if own is not None:  # greedy: vLLM's argmax path generates what HF's does
        assert [g.tokens for g in gens] == [o.tokens for o in own]
