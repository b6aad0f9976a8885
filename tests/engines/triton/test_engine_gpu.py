"""lpdiff.engines.triton on GPUs at full width and reduced depth (4 layers of Qwen3-30B-A3B and gpt-oss-20b, built on
the device with the catalog's seeded recipe), fp32 with IEEE matmuls on both sides:

- gpu1: against HF+PEFT (engines.hf), base, one adapter, and two adapters plus base rows in one batch;
- gpu2 / gpu4: tensor parallelism 2 and 4 against TP 1.

Random-init routers have near-ties: where a token's smallest top-k routing margin is below NEAR_TIE, two correct
fp32 implementations may pick different experts, and later tokens of the same prompt see the flipped token through
attention. As lpdiff's verdicts do (PromptLogprobs.router_margin), positions at or after a near-tie are left out
of the max; prompts must keep most of their positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.harness.types import AdapterSpec
from tests.helpers.graph_replay import assert_replay_equals_eager

TOL = 1e-4
NEAR_TIE = 1e-5
MODELS = ["qwen3-30b-a3b", "gpt-oss-20b"]
LENS = [512, 333, 128, 480, 64, 257]  # ragged; longer and shorter than gpt-oss's 128-token window
MIXED = ["a", None, "b", "a", None, "b"]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(n: int):
    return pytest.mark.skipif(_gpus() < n, reason=f"needs {n} GPU(s), this machine has {_gpus()}")


@pytest.fixture(scope="module", params=MODELS)
def case(request, tmp_path_factory):
    from lpdiff.harness.spec.adapters import generate_adapter
    from lpdiff.harness.spec.catalog import get_model, load_hf_model

    if _gpus() < 1:
        pytest.skip("needs a GPU")
    spec = get_model(request.param, num_layers=4)
    root = tmp_path_factory.mktemp(request.param)
    model = load_hf_model(spec, torch.float32, "cuda")
    # two adapters of different ranks and layouts: per-expert A/B on attention and experts, shared-outer experts
    a = generate_adapter(model, root / "a", groups=("attention", "experts"), rank=16, alpha=32, seed=1)
    b = generate_adapter(model, root / "b", groups=("experts",), rank=8, alpha=8, seed=2, shared_outer=True)
    vocab = model.config.vocab_size
    del model
    torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENS]
    return spec, {"a": AdapterSpec("a", a.path), "b": AdapterSpec("b", b.path)}, prompts


def _run(engine, spec, adapters, prompts, choices, tp=1, options=None):
    from lpdiff.engines.base import open_engine

    # the reference is HF's eager expert loop: the plainest fp32 computation transformers has
    options = {"experts_impl": "eager"} if engine == "hf" else (options or {})
    with open_engine(
        engine, EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cuda", tp=tp, options=options)
    ) as eng:
        out = [eng.prompt_logprobs(prompts, c) for c in choices]
    torch.cuda.empty_cache()
    return out


def _check(got, ref, margins, what):
    d = np.concatenate([np.abs(x.logprobs - y.logprobs) for x, y in zip(got, ref)])
    # flagged: at or after the first near-tie of its prompt (logprobs[i] depends on tokens 0..i)
    flagged = np.concatenate([np.maximum.accumulate(m[:-1] < NEAR_TIE) for m in margins])
    print(
        f"{what}: max |d| {d.max():.2e} (all), {d[~flagged].max():.2e} (without {flagged.sum()} positions at or "
        f"after a near-tie, of {flagged.size}), mean {d.mean():.2e}"
    )
    assert flagged.mean() < 0.5, f"{what}: {flagged.sum()} of {flagged.size} positions follow a router near-tie"
    assert d[~flagged].max() <= TOL, f"{what}: max |d| {d[~flagged].max():.2e} > {TOL}"


@needs(1)
@pytest.mark.gpu1
def test_fp32_parity_with_hf_peft_full_width(case):
    spec, adapters, prompts = case
    choices = [None, "a", MIXED]
    ref = _run("hf", spec, adapters, prompts, choices)
    got = _run("triton", spec, adapters, prompts, choices)
    for c, g, r in zip(choices, got, ref):
        _check(g, r, [p.router_margin for p in g], f"{spec.name} adapter={c}")
    effect = max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(got[1], got[0]))
    assert effect > 100 * TOL, f"adapter moved logprobs by only {effect:.2e}"


@needs(1)
@pytest.mark.gpu1
def test_fp32_parity_padding_modes(case):
    """The expert GEMMs' other padding modes (moe_padding: zeros in the padding rows; half-height tiles for a
    group's last, at most half-used block) against HF+PEFT on the mixed batch (two adapters and base rows)."""
    spec, adapters, prompts = case
    ref = _run("hf", spec, adapters, prompts, [MIXED])[0]
    for padding in ("zero", "half"):
        got = _run("triton", spec, adapters, prompts, [MIXED], options={"moe_padding": padding})[0]
        _check(got, ref, [p.router_margin for p in got], f"{spec.name} moe_padding={padding}")


@needs(1)
@pytest.mark.gpu1
@pytest.mark.parametrize("impl", ["triton", "flash"])
@pytest.mark.parametrize("window,sinks", [(None, False), (16, False), (None, True), (16, True)])
def test_bf16_varlen_attention_matches_fp32_sdpa(window, sinks, impl):
    """The bf16 paths (the Triton kernel, "auto"'s; FlashAttention varlen + sink rescaling by the logsumexp) against
    the fp32 SDPA path on the same ragged batch: GQA 8/2 heads, prompts shorter and longer than the window."""
    from lpdiff.engines.triton.archs import model_config
    from lpdiff.engines.triton.attention import attention
    from lpdiff.engines.triton.batch import Batch
    from lpdiff.harness.spec.catalog import get_model, hf_config

    cfg = model_config(hf_config(get_model("gpt-oss-20b", num_layers=1)))
    lens = [37, 128, 200, 5]
    b = Batch.build([[0] * n for n in lens], [-1] * len(lens), cfg, torch.bfloat16, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    T, h, hkv, d = b.num_tokens, 8, 2, 64
    q, k, v = (torch.randn(T, n, d, generator=g, device="cuda") for n in (h, hkv, hkv))
    s = torch.randn(h, generator=g, device="cuda") * 2 if sinks else None
    ref = attention(q, k, v, b, d**-0.5, window, s, impl="sdpa")
    got = attention(*(t.bfloat16() for t in (q, k, v)), b, d**-0.5, window, s.bfloat16() if sinks else None, impl=impl)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.3g}"


@needs(1)
@pytest.mark.gpu1
@pytest.mark.parametrize("K,H,weight_fp32", [(8, 2048, False), (4, 2880, True)], ids=["qwen3", "gpt-oss"])
def test_topk_sum_fused_into_norm_bf16(K, H, weight_fp32):
    """The compiled add_rms_norm with the MoE's (T, K, H) top-k outputs at 4096 tokens, bf16: its residual equals
    the k-order torch reference bit for bit, and the unfused path (torch's sum over K, then the (T, H) kernel)
    except where torch's CUDA reduction adds in another order and an inexact fp32 sum lands on the other side of a
    bf16 rounding boundary (printed; bounded at 1e-5 of the elements). Rows whose residual agrees are normed alike."""
    from lpdiff.engines.triton.norm import add_rms_norm, add_rms_norm_torch

    g = torch.Generator(device="cuda").manual_seed(0)
    T = 4096
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    # weighted per-pair outputs: magnitudes spread over a few decades, as routing weights and experts make them
    delta = (
        torch.randn(T, K, H, generator=g, device="cuda") * torch.exp(torch.randn(T, K, 1, generator=g, device="cuda"))
    ).bfloat16()
    w = (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(torch.float32 if weight_fp32 else torch.bfloat16)
    out, s = add_rms_norm(x, delta, w, 1e-6, weight_fp32)
    assert torch.equal(s, add_rms_norm_torch(x, delta, w, 1e-6, weight_fp32)[1])
    out_u, s_u = add_rms_norm(x, delta.sum(dim=1), w, 1e-6, weight_fp32)
    differ = s != s_u
    print(f"K={K}: {int(differ.sum())} of {differ.numel()} residual elements differ from the unfused path")
    assert differ.sum() <= 1e-5 * differ.numel()
    same_rows = ~differ.any(dim=1)
    assert torch.equal(out[same_rows], out_u[same_rows])


@needs(1)
@pytest.mark.gpu1
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(case, dtype):
    """A replayed CUDA graph gives the eager forward's logprobs, top-k and margins bit for bit: on the captured
    prompts (3rd call) and on other token ids of the same layout (the graph's only input), mixed adapters and base
    rows in one batch; the 2nd call captures, so the 3rd and 4th are replays (counted)."""
    spec, adapters, prompts = case
    vocab = max(max(p) for p in prompts) + 1
    g = torch.Generator().manual_seed(1)
    other = [torch.randint(0, vocab, (len(p),), generator=g).tolist() for p in prompts]
    assert_replay_equals_eager(spec, adapters, dtype, [prompts, prompts, prompts, other], MIXED)


TP_CHOICES = [None, MIXED]


@pytest.fixture(scope="module")
def tp1(case):
    """The TP=1 runs every TP size is compared with (computed once per model)."""
    spec, adapters, prompts = case
    return _run("triton", spec, adapters, prompts, TP_CHOICES)


@pytest.mark.parametrize(
    "tp", [pytest.param(2, marks=[needs(2), pytest.mark.gpu2]), pytest.param(4, marks=[needs(4), pytest.mark.gpu4])]
)
def test_tensor_parallel_matches_tp1_fp32(case, tp1, tp):
    spec, adapters, prompts = case
    choices, ref = TP_CHOICES, tp1
    got = _run("triton", spec, adapters, prompts, choices, tp=tp)
    for c, g, r in zip(choices, got, ref):
        _check(g, r, [p.router_margin for p in r], f"{spec.name} tp={tp} adapter={c}")
