"""The triton engine's mamba_scan option (engines/triton/mamba.py scan_impl): which scan each run takes, and the
chunked scan (kernels/ssd_chunked.py, interpreted on CPU) inside the whole Nemotron-H forward against the default
path, with adapters and base rows in one pack, and under the state_not_reset fault."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.engines.triton.mamba import scan_impl
from lpdiff.engines.triton.options import TritonOptions
from lpdiff.harness.spec.errors import InputError
from lpdiff.kernels import faults

ZOO = "tiny-nemotron-h"  # chunk_size 32
LENS = [40, 3, 33]  # 76 tokens: the first prompt crosses a chunk edge, the last ends inside a chunk
CHOICE = ["mamba", None, "mamba"]


def test_option_is_checked_and_defaults_to_the_recurrence():
    assert TritonOptions().mamba_scan == "recurrence"
    with pytest.raises(InputError, match="mamba_scan"):
        TritonOptions(mamba_scan="chunk")


@pytest.mark.parametrize(
    ("option", "cuda", "dtype", "want"),
    [
        ("auto", True, torch.bfloat16, "chunked"),
        ("auto", True, torch.float16, "chunked"),
        ("auto", True, torch.float32, "recurrence"),  # fp32 runs keep the 1e-4 parity with HF+PEFT
        ("auto", False, torch.bfloat16, "recurrence"),
        ("chunked", False, torch.float32, "chunked"),
        ("recurrence", True, torch.bfloat16, "recurrence"),
    ],
)
def test_scan_impl(option, cuda, dtype, want):
    # scan_impl reads only these two attributes of the activations; no CUDA tensor can be made on a CPU machine
    assert scan_impl(option, SimpleNamespace(is_cuda=cuda, dtype=dtype)) == want


def _run(options: dict) -> tuple[list, list]:
    """-> (logprobs, logprobs under the state_not_reset fault) from one engine (TP 1: the fault is this process's)."""
    from lpdiff.harness.spec.resolve import resolve_model, zoo_adapters

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in LENS]
    cfg = EngineConfig(
        model=resolve_model(ZOO),
        adapters={"mamba": zoo_adapters(ZOO)["mamba"]},
        dtype="float32",
        device="cpu",
        options={"impl": "torch", **options},
    )
    with open_engine("triton", cfg) as eng:
        clean = eng.prompt_logprobs(prompts, CHOICE, top_k=0)
        with faults.injected("state_not_reset"):
            return clean, eng.prompt_logprobs(prompts, CHOICE, top_k=0)


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b))


def test_chunked_scan_in_the_forward_matches_the_default_path():
    """fp32 on CPU, the chunked kernels interpreted (exact fp32 dots there): within 1e-4 of the torch path (seen
    1.1e-5 on the zoo's 5 prompts of 5..300 tokens), and so under the state_not_reset fault, which moves the later
    prompts far more than that (so a chunked path that ignored the fault, or the reset, would fail)."""
    (ref, ref_f), (got, got_f) = _run({}), _run({"mamba_scan": "chunked"})
    assert _maxdiff(got, ref) <= 1e-4
    assert _maxdiff(got_f, ref_f) <= 1e-4
    assert _maxdiff(ref_f[1:], ref[1:]) > 1e-2


@pytest.mark.gpu1
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_cuda_chunked_against_the_recurrence():
    """bf16 on CUDA, where "auto" takes the chunked kernels: within bf16 noise of the recurrence, adapters and base
    rows in one pack. (Their CUDA graphs replay bit for bit: tests/engines/triton/test_hybrid_graphs.py.)"""
    from lpdiff.harness.spec.resolve import resolve_model, zoo_adapters

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in (300, 17, 129, 64)]
    choice = ["mamba", None, "mamba", None]
    runs = {}
    for scan in ("recurrence", "auto"):
        cfg = EngineConfig(
            model=resolve_model(ZOO),
            adapters={"mamba": zoo_adapters(ZOO)["mamba"]},
            dtype="bfloat16",
            device="cuda",
            options={"mamba_scan": scan, "cuda_graphs": 0},
        )
        with open_engine("triton", cfg) as eng:
            runs[scan] = eng.prompt_logprobs(prompts, choice, top_k=0)
    d = _maxdiff(runs["auto"], runs["recurrence"])
    print(f"chunked vs recurrence, bf16 logprobs: max |d| {d:.3g}")
    assert d <= 5e-2
