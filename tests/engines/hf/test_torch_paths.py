"""The hf engine's fp32 runs call transformers' torch delta rule even where a kernel package makes the modeling
module's name call its kernel (engines/hf_torch_paths.py: fla's Triton dots run fp32 at TF32); 16-bit runs call the
kernel. The kernel is a stand-in built by transformers' own decorator (use_kernel_func_from_hub_with_fallback) around
a stand-in package, exactly as transformers wraps fla when it imports. Tiny zoo Qwen3.5-MoE, CPU."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.engines.hf_torch_paths import torch_paths
from lpdiff.harness.commands.run import Job, resolve_job

MODELING = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
NAME = "torch_chunk_gated_delta_rule"
STANDIN_PACKAGE = "lpdiff_test_fla_standin"
OFFSET = 1e-3


@pytest.fixture(scope="module")
def tiny():
    spec, adapters, _ = resolve_job(Job(model="tiny-qwen3.5-moe", adapters=("linear_attention",)))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (9, 83, 23)]
    return spec, adapters, prompts


@pytest.fixture
def kernel(monkeypatch):
    """Installs the stand-in kernel as the modeling module's ``torch_chunk_gated_delta_rule``; yields its call log."""
    import importlib

    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    mod = importlib.import_module(MODELING)
    torch_fn = getattr(mod, NAME).__wrapped__  # on this machine no fla: the name wraps the torch function
    calls: list[int] = []

    def chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        """Stands in for fla's chunk_gated_delta_rule, which needs CUDA (Triton on a GPU): the torch delta rule
        plus 1e-3 on every output, a difference no fp32 reference may carry (fla's own is its TF32 rounding)."""
        calls.append(query.shape[1])
        out, state = torch_fn(
            query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel
        )
        return out + OFFSET, state

    package = types.ModuleType(STANDIN_PACKAGE)
    package.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, STANDIN_PACKAGE, package)
    wrapped = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", STANDIN_PACKAGE)(torch_fn)
    monkeypatch.setattr(mod, NAME, wrapped)
    return mod, wrapped, calls


def _logprobs(spec, adapters, prompts, dtype, eng=None):
    choice = [None, "linear_attention", "linear_attention"]
    if eng is not None:
        return [r.logprobs for r in eng.prompt_logprobs(prompts, choice)]
    with open_engine("hf", EngineConfig(model=spec, adapters=adapters, dtype=dtype, device="cpu")) as e:
        return [r.logprobs for r in e.prompt_logprobs(prompts, choice)]


def test_fp32_runs_the_torch_delta_rule_bf16_the_kernel(tiny, kernel, monkeypatch):
    spec, adapters, prompts = tiny
    mod, wrapped, calls = kernel
    with monkeypatch.context() as m:  # the module as transformers leaves it without a kernel package
        m.setattr(mod, NAME, wrapped.__wrapped__)
        want32 = _logprobs(spec, adapters, prompts, "float32")
    assert getattr(mod, NAME) is wrapped and not calls
    with open_engine("hf", EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu")) as eng:
        got32 = _logprobs(spec, adapters, prompts, "float32", eng)
        n = len(prompts[1])
        cap = eng.capture_layers([prompts[1]], "linear_attention", steps=[0])  # nested in the step tracer's wrap
    assert not calls, "the fp32 reference called the kernel"
    for g, w in zip(got32, want32):
        np.testing.assert_array_equal(g, w)
    assert cap[0, "linear_attention.delta_rule"].shape[0] == n
    assert getattr(mod, NAME) is wrapped  # the kernel is the module's name again after the run
    _logprobs(spec, adapters, prompts, "bfloat16")
    assert calls, "the bf16 run did not call the kernel"


def test_names_restored_after_an_error(kernel):
    mod, wrapped, _ = kernel
    with pytest.raises(RuntimeError, match="inside"), torch_paths([mod]) as names:
        assert f"{MODELING}.{NAME}" in names and getattr(mod, NAME) is not wrapped
        raise RuntimeError("inside")
    assert getattr(mod, NAME) is wrapped
