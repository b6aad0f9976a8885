"""The triton engine on Qwen3.5-MoE (engines/triton/qwen3_5.py, gdn.py) against HF+PEFT (engines.hf) in fp32 on the
tiny zoo model (3 Gated DeltaNet layers + 1 gated full-attention layer), on CPU, with the zoo's adapters (one per
module group the generator writes for Qwen3.5, and "all").

Prompts: fresh random ids of ragged lengths packed into one batch, one of 300 tokens so that the chunked delta rule
runs across several 64-token chunks and a prompt boundary falls inside a chunk of the packed view."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.engines.triton import gdn
from lpdiff.harness.commands.run import Job, resolve_job

TOL = 1e-4
MODEL = "tiny-qwen3.5-moe"
GROUPS = ("linear_attention", "attention", "shared_expert", "experts")
LENS = [16, 300, 5, 37, 70, 23]


@pytest.fixture(scope="module")
def tiny():
    spec, adapters, _ = resolve_job(Job(model=MODEL, adapters=("all", *GROUPS)))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in LENS]
    return spec, adapters, prompts


def _run(engine, spec, adapters, prompts, choices, **kw):
    with open_engine(engine, EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cpu", **kw)) as e:
        return [e.prompt_logprobs(prompts, c) for c in choices]


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b))


# the base model, one adapter for the whole batch, and every group's adapter beside base rows in one batch
CHOICES = [None, "all", ["linear_attention", None, "attention", "shared_expert", "experts", "all"]]
# the triton side reads the experts adapter in the per-expert layout too (row 4 of the mixed batch); HF+PEFT reads
# the PEFT 3D original (PEFT ignores per-expert keys on Qwen3.5: engines/hf.py _PEFT_IGNORES_PER_EXPERT)
TRITON_CHOICES = [None, "all", ["linear_attention", None, "attention", "shared_expert", "experts_pe", "all"]]


@pytest.fixture(scope="module")
def triton_runs(tiny, tmp_path_factory):
    from lpdiff.harness.spec.adapters import convert_adapter
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.types import AdapterSpec

    spec, adapters, prompts = tiny
    pe = convert_adapter(
        adapters["experts"].path, tmp_path_factory.mktemp("pe") / "experts_pe", "per_expert", hf_config(spec)
    )
    return _run(
        "triton", spec, {**adapters, "experts_pe": AdapterSpec("experts_pe", str(pe.path))}, prompts, TRITON_CHOICES
    )


@pytest.mark.cpu
def test_parity_with_hf_peft_base_adapters_and_mixed_batch(tiny, triton_runs):
    spec, adapters, prompts = tiny
    hf = _run("hf", spec, adapters, prompts, CHOICES)
    for choice, got, ref in zip(CHOICES, triton_runs, hf):
        assert _maxdiff(got, ref) <= TOL, (choice, _maxdiff(got, ref))
    # each group's adapter moves its prompt far beyond the tolerance (dropping it could not pass)
    for i, name in enumerate(CHOICES[2]):
        if name is not None:
            moved = float(np.abs(hf[2][i].logprobs - hf[0][i].logprobs).max())
            assert moved > 100 * TOL, (name, moved)
    assert all(np.isfinite(r.router_margin).all() and len(r.router_margin) == n for r, n in zip(triton_runs[0], LENS))


@pytest.mark.cpu
def test_packed_prompts_equal_each_prompt_alone(tiny, triton_runs):
    """Conv window and recurrent state start afresh at every prompt: a packed prompt computes what it computes
    alone (checked on the 300-token prompt, which follows a 16-token one, and the 5-token one after it)."""
    spec, adapters, prompts = tiny
    alone = (
        _run("triton", spec, adapters, [prompts[1]], ["all"])[0]
        + _run("triton", spec, adapters, [prompts[2]], [None])[0]
    )
    assert _maxdiff([triton_runs[2][1]], [triton_runs[0][1]]) <= 1e-5  # a base row among adapter rows
    assert _maxdiff(alone, [triton_runs[1][1], triton_runs[0][2]]) <= 1e-5


@pytest.mark.cpu
def test_tensor_parallel_2_equals_tp1(tiny, triton_runs):
    spec, adapters, prompts = tiny
    tp2 = _run("triton", spec, adapters, prompts, [CHOICES[2]], tp=2)[0]
    assert _maxdiff(tp2, triton_runs[2]) <= TOL


@pytest.mark.parametrize("lens", [[150], [7, 64, 129], [5, 200, 3]])
def test_chunked_delta_rule_matches_the_recurrence(lens):
    """The chunked form (gdn.chunk_gated_delta_rule_torch) on a packed batch (its padded view, or prompt by prompt
    where that view would be mostly padding: [5, 200, 3]) against the token-by-token recurrence of each prompt
    alone; odd widths, lengths off the 64-token chunk."""
    from lpdiff.engines.triton.batch import Batch

    g = torch.Generator().manual_seed(len(lens))
    T, h, dk, dv = sum(lens), 3, 12, 20
    q, k = torch.randn(T, h, dk, generator=g), torch.randn(T, h, dk, generator=g)
    v = torch.randn(T, h, dv, generator=g)
    decay = -torch.rand(T, h, generator=g) * 2
    beta = torch.rand(T, h, generator=g)
    cfg = type("C", (), {"rope_inv_freq": torch.ones(1), "rope_attention_scaling": 1.0})
    batch = Batch.build([[0] * n for n in lens], [-1] * len(lens), cfg, torch.float32, torch.device("cpu"))
    got = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "torch")
    start = 0
    for n in lens:
        s = slice(start, start + n)
        ref = gdn.gated_delta_rule_recurrent(*(t[s][None] for t in (q, k, v, decay, beta)))[0]
        assert torch.allclose(got[s], ref, atol=2e-5, rtol=1e-5), (n, (got[s] - ref).abs().max())
        start += n


def test_conv_does_not_read_across_prompts():
    from lpdiff.engines.triton.batch import Batch

    cfg = type("C", (), {"rope_inv_freq": torch.ones(1), "rope_attention_scaling": 1.0})
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 6, generator=g), torch.randn(6, 4, generator=g)
    packed = gdn.causal_conv1d(x, w, Batch.build([[0] * 4, [0] * 5], [-1, -1], cfg, torch.float32, torch.device("cpu")))
    one = Batch.build([[0] * 5], [-1], cfg, torch.float32, torch.device("cpu"))
    assert torch.allclose(packed[4:], gdn.causal_conv1d(x[4:], w, one), atol=0, rtol=0)


def test_an_unsupported_target_is_one_clear_error(tiny):
    """LoRA on the router (or any module outside the groups) is refused by name, not silently dropped."""
    from lpdiff.engines.triton.loader import open_source
    from lpdiff.engines.triton.options import TritonOptions
    from lpdiff.engines.triton.qwen3_5 import build
    from lpdiff.engines.triton.shard import Shard
    from lpdiff.harness.spec.adapters import load_canonical

    spec, adapters, _ = tiny
    hf, source = open_source(spec, torch.float32, torch.device("cpu"))
    ad = load_canonical(adapters["attention"].path, hf)
    a, b = next(iter(ad.dense.values()))
    bad = dataclasses.replace(ad, dense={**ad.dense, "model.layers.0.mlp.gate": (a, b[:8])})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate.*supported targets"):
        build(
            hf,
            source,
            {"bad": bad},
            Shard(),
            torch.float32,
            torch.device("cpu"),
            lambda t: t,
            TritonOptions.from_dict({}),
        )


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
@pytest.mark.parametrize("lens", [[300, 17, 1024, 64]])
def test_fla_delta_rule_matches_the_torch_form_in_bf16(lens):
    """fla-core's chunk_gated_delta_rule (the 16-bit CUDA path) against the torch form on the same packed bf16
    inputs, several prompts per call (its cu_seqlens reset), 2 key heads shared by 4 value heads per GVA repeat."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from lpdiff.engines.triton.batch import Batch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    T, h, dk, dv = sum(lens), 4, 128, 128
    q, k = (torch.randn(T, h, dk, generator=g, device=dev).bfloat16() for _ in range(2))
    v = torch.randn(T, h, dv, generator=g, device=dev).bfloat16()
    decay = -torch.rand(T, h, generator=g, device=dev) * 0.3
    beta = torch.rand(T, h, generator=g, device=dev).bfloat16()
    cfg = type("C", (), {"rope_inv_freq": torch.ones(1), "rope_attention_scaling": 1.0})
    batch = Batch.build([[0] * n for n in lens], [-1] * len(lens), cfg, torch.bfloat16, dev)
    fla = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "fla").float()
    ref = gdn.gated_delta_rule(q, k, v, decay, beta, batch, "torch").float()
    err = (fla - ref).abs().max().item()
    # bf16 output rounding of values of magnitude ~|ref|: a few ulps
    assert err <= 4 * 2**-8 * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
def test_fp32_on_cuda_matches_hf_peft(tiny):
    """The CUDA path (Triton norms, router, MoE-LoRA kernels, cuBLAS LoRA linears; the delta rule in its torch form
    in fp32) against HF+PEFT fp32 on the CPU."""
    spec, adapters, prompts = tiny
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cuda")) as e:
        got = [e.prompt_logprobs(prompts, c) for c in CHOICES]
    hf = _run("hf", spec, adapters, prompts, CHOICES)
    for choice, a, b in zip(CHOICES, got, hf):
        assert _maxdiff(a, b) <= TOL, (choice, _maxdiff(a, b))


@pytest.mark.cpu
def test_module_capture_matches_hf_modules(tiny):
    """lpdiff bisect's module re-runs (Qwen35Model.capture_modules through capture.py): fed HF+PEFT's own inputs
    to each layer's token mixer (linear or full attention) and routed experts, the runtime's outputs match HF's
    modules, with the adapter and (``_base``) without it, and its routing picks HF's experts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec, adapters, prompts = tiny
    rows = [p[:12] for p in prompts if len(p) >= 12][:3]  # HF captures equal-length rows, flattened row-major
    hf = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32).eval()
    base_out: dict = {}
    cap, calls, handles = {}, {}, []
    for i, layer in enumerate(hf.model.layers):
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn

        def mix_hook(mod, args, kwargs, out, i=i):
            calls[i] = (mod, args, kwargs)
            cap[i, "attention_in"] = kwargs["hidden_states"].reshape(-1, kwargs["hidden_states"].shape[-1])
            cap[i, "attention_ref"] = (out[0] if isinstance(out, tuple) else out).reshape(cap[i, "attention_in"].shape)

        def experts_hook(mod, args, out, i=i):
            cap[i, "experts_in"], cap[i, "router_ids"], cap[i, "router_weights"] = args[:3]
            cap[i, "experts_ref"] = out

        handles += [
            mixer.register_forward_hook(mix_hook, with_kwargs=True),
            layer.mlp.experts.register_forward_hook(experts_hook),
        ]
    peft = PeftModel.from_pretrained(hf, adapters["all"].path).eval()
    with torch.no_grad():
        peft(input_ids=torch.tensor(rows), use_cache=False)  # a cache would make the re-runs continue it
        for h in handles:
            h.remove()
        with peft.disable_adapter():
            for i, (mod, args, kwargs) in calls.items():
                out = mod(*args, **kwargs)
                base_out[i] = (out[0] if isinstance(out, tuple) else out).reshape(cap[i, "attention_in"].shape)
    inputs = {k: v for k, v in cap.items() if not k[1].endswith("_ref")}
    with open_engine(
        "triton", EngineConfig(model=spec, adapters={"all": adapters["all"]}, dtype="float32", device="cpu")
    ) as eng:
        got = eng.capture_layers(rows, "all", inputs=inputs)
    for i in range(len(calls)):
        for name, ref in (
            ("attention", cap[i, "attention_ref"]),
            ("attention_base", base_out[i]),
            ("experts", cap[i, "experts_ref"]),
        ):
            err = float((got[i, name] - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, (i, name, err)
        assert torch.equal(got[i, "router_ids"], cap[i, "router_ids"])
    assert float((got[0, "attention"] - got[0, "attention_base"]).abs().max()) > 1e-2  # the adapter is in it


@pytest.mark.gpu1
@pytest.mark.skipif(not _cuda(), reason="needs a GPU")
def test_full_width_reduced_depth_matches_hf_peft(tmp_path):
    """Qwen3.5-35B-A3B at full width, first 4 layers (3 Gated DeltaNet + 1 gated attention; seeded weights), fp32:
    base, an every-group adapter in both expert layouts and a linear-attention-only one, prompts of 16..4096 tokens
    packed, against HF+PEFT prompt by prompt (transformers' torch GDN: keep fla off the path of this process)."""
    from peft import PeftModel

    from lpdiff.harness.spec.adapters import convert_adapter, generate_adapter
    from lpdiff.harness.spec.catalog import get_model, load_hf_model
    from lpdiff.harness.types import AdapterSpec

    if gdn.fla_available():
        pytest.skip("with fla importable, transformers runs fla's TF32-precision kernel for HF's fp32 reference")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    spec = get_model("qwen3.5-35b-a3b", num_layers=4)
    model = load_hf_model(spec, torch.float32, "cuda")
    groups = ("attention", "linear_attention", "shared_expert", "experts")
    paths = {
        "all": generate_adapter(model, tmp_path / "all", groups=groups, rank=16, alpha=32, seed=1).path,
        "la": generate_adapter(model, tmp_path / "la", groups=("linear_attention",), rank=8, seed=2).path,
    }
    pe = convert_adapter(paths["all"], tmp_path / "all_pe", "per_expert", model.config).path
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (16, 300, 4096, 1024, 77)]
    refs = {}
    with torch.no_grad():
        peft = PeftModel.from_pretrained(model, paths["all"], adapter_name="all")
        peft.load_adapter(paths["la"], adapter_name="la")
        peft.eval()

        def logprobs(p, net=peft):
            ids = torch.tensor([p], device="cuda")
            lg = net(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
            return lg[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu().numpy()

        for name in ("all", "la"):
            peft.set_adapter(name)
            refs[name] = [logprobs(p) for p in prompts]
        with peft.disable_adapter():
            refs[None] = [logprobs(p) for p in prompts]
    del peft, model, logprobs  # the closure's default holds the model too
    torch.cuda.empty_cache()
    adapters = {
        "all": AdapterSpec("all", str(paths["all"])),
        "la": AdapterSpec("la", str(paths["la"])),
        "all_pe": AdapterSpec("all_pe", str(pe)),
    }
    mixed = ["all", None, "la", "all_pe", "all"]
    with open_engine("triton", EngineConfig(model=spec, adapters=adapters, dtype="float32", device="cuda")) as e:
        for choice in (None, "all_pe", mixed):
            got = e.prompt_logprobs(prompts, choice)
            names = choice if isinstance(choice, list) else [choice] * len(prompts)
            for i, (r, n) in enumerate(zip(got, names)):
                ref = refs[{"all_pe": "all"}.get(n, n)][i]
                assert float(np.abs(r.logprobs - ref).max()) <= TOL, (choice, i)
    for name in ("all", "la"):  # each adapter moves the output far beyond the tolerance
        assert max(float(np.abs(a - b).max()) for a, b in zip(refs[name], refs[None])) > 100 * TOL, name


def test_checkpoint_under_the_hub_wrappers_language_model_names(tiny, triton_runs, tmp_path):
    """The Hub checkpoint (Qwen3_5MoeForConditionalGeneration) keeps the text model under model.language_model.*
    beside model.visual.*: the runtime reads those names and computes what it computes from model.* (to rounding:
    the batches differ)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    spec, adapters, prompts = tiny
    src = Path(spec.path)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        renamed = {
            ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): f.get_tensor(k)
            for k in f.keys()  # noqa: SIM118 (safe_open is not iterable)
        }
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(4, 3)  # a vision tower the runtime must skip
    save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    wrapped = dataclasses.replace(spec, path=str(tmp_path))
    short = [p[:20] for p in prompts[:2]]  # causal: a prefix's logprobs are those of the whole prompt's first rows
    got = _run("triton", wrapped, {"all": adapters["all"]}, short, ["all"])[0]
    for r, full in zip(got, triton_runs[1]):
        assert float(np.abs(r.logprobs - full.logprobs[:19]).max()) <= 1e-5
