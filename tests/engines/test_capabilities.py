"""Each engine declares its facts (engines/capabilities.py): readable without the engine's library, and the
harness's tables (layouts served per arch, rank limit, metamorphic modes) come out as they were."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lpdiff.engines import ENGINES, Capabilities, capabilities, engine_class, engine_modes, layouts_for, max_rank
from lpdiff.engines.base import CAPTURE_POINTS


def test_capabilities_import_without_the_engines_libraries():
    """In a fresh interpreter: reading every registered engine's capabilities imports neither vLLM nor SGLang (the
    CPU box that runs doctor has neither; Triton is lpdiff's own dependency, which the triton engine's package
    imports)."""
    code = (
        "import json, sys\nfrom lpdiff.engines import ENGINES, capabilities\n"
        "caps = {e: capabilities(e).engine for e in ENGINES}\n"
        "print(json.dumps([caps, sorted(m for m in ('vllm', 'sglang', 'sgl_kernel') if m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    caps, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert caps == {e: e for e in ENGINES}
    assert heavy == [], f"reading capabilities imported {heavy}"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_engine_declares_a_consistent_object(engine):
    caps = capabilities(engine)
    assert isinstance(caps, Capabilities) and caps.engine == engine
    assert caps.dtypes and caps.tp and 1 in caps.tp and caps.layouts
    assert caps.moe_rank is None or caps.max_rank is None or caps.moe_rank <= caps.max_rank
    assert hasattr(engine_class(engine), "capture_layers") == caps.per_layer_capture
    for mode in caps.modes:
        assert isinstance(mode.options, dict)


def test_unknown_engine_names_the_known_ones():
    with pytest.raises(KeyError, match="known engines: hf, sglang, triton, vllm"):
        capabilities("nope")


# what harness/commands/check.py served each engine (ENGINE_LAYOUTS, ARCH_LAYOUTS) before the facts moved here; hf
# since reads per-expert files on every arch (it converts them to PEFT 3D before PEFT loads them)
SERVED = {
    ("vllm", "gpt_oss"): ("peft3d",),
    ("vllm", "qwen3_moe"): ("per_expert",),
    ("vllm", "qwen3_5_moe"): ("peft3d",),  # per-expert names refused at load (vllm-qwen3.5-per-expert)
    ("vllm", "nemotron_h"): ("per_expert",),
    **{("sglang", a): ("per_expert",) for a in ("qwen3_moe", "gpt_oss", "qwen3_5_moe")},
    ("sglang", "nemotron_h"): ("per_expert_gate",),
    **{("triton", a): ("peft3d", "per_expert") for a in ("qwen3_moe", "gpt_oss")},
    **{("hf", a): ("peft3d", "per_expert") for a in ("qwen3_moe", "gpt_oss", "qwen3_5_moe", "nemotron_h", "qwen3")},
}


@pytest.mark.parametrize("engine,arch", sorted(SERVED))
def test_layouts_for_is_the_served_table(engine, arch):
    assert layouts_for(engine, arch) == SERVED[engine, arch]


def test_layouts_follow_the_declared_defects():
    """A layout drops out where an unconditional error defect of that arch says the engine gets it wrong; a
    defect tied to a TP size, a condition or a warning leaves it in."""
    vllm = capabilities("vllm")
    assert vllm.defect("vllm-per-expert-interleaved").applies("gpt_oss", "per_expert")
    assert not vllm.defect("vllm-per-expert-interleaved").applies("qwen3_moe", "per_expert")
    assert "per_expert" in layouts_for("vllm", "qwen3_moe")  # its TP 4 fault does not remove it
    assert [d.id for d in vllm.defects("qwen3_moe", "per_expert", tp=4)].count("vllm-moe-lora-tp4-fault") == 1
    assert "vllm-moe-lora-tp4-fault" not in [d.id for d in vllm.defects("qwen3_moe", "per_expert", tp=2)]
    # it may die (measured both ways on Qwen3 at TP 4); gpt-oss, and Nemotron-H at its capped step, ran at TP 4
    tp4 = {
        a: [d.severity for d in vllm.defects(a, "per_expert", tp=4) if d.id == "vllm-moe-lora-tp4-fault"]
        for a in ("qwen3_moe", "nemotron_h", "gpt_oss")
    }
    assert tp4 == {"qwen3_moe": ["warning"], "nemotron_h": [], "gpt_oss": []}
    # one id per arch: the nemotron_h entry wins over the any-arch fallback
    assert vllm.defect("router-target", "nemotron_h").severity == "error"
    assert vllm.defect("router-target", "qwen3_moe").severity == "info"
    # what PEFT alone does with a per-expert file is info for hf (its engine converts the file): per_expert stays
    hf = capabilities("hf")
    for arch, code in (
        ("gpt_oss", "per-expert-ignored-by-peft"),
        ("qwen3_5_moe_text", "per-expert-ignored-by-peft"),
        ("nemotron_h", "per-expert-ignored-by-peft"),
        ("qwen3_moe", "per-expert-converted-by-peft"),
        ("mixtral", "per-expert-unknown"),
    ):
        found = hf.defects(arch, "per_expert")
        assert code in [d.id for d in found], (arch, [d.id for d in found])
        assert not [d.id for d in found if d.severity != "info" and not d.when], arch
        assert "per_expert" in hf.layouts_for(arch)


def test_arch_lora_targets():
    """SGLang's LoRA modules differ per hybrid (its models' supported_lora_modules); other archs keep the common set."""
    sglang = capabilities("sglang")
    qwen35 = sglang.lora_targets_for("qwen3_5_moe_text")  # the in-memory text arch reads the checkpoint's entry
    assert {"in_proj_qkvz", "out_proj"} <= qwen35 and not {"in_proj_qkv", "in_proj_z", "in_proj_b"} & qwen35
    assert {"in_proj", "out_proj", "fc1_latent_proj"} <= sglang.lora_targets_for("nemotron_h")
    assert sglang.lora_targets_for("qwen3_moe") == sglang.lora_targets and "out_proj" not in sglang.lora_targets
    assert capabilities("vllm").lora_targets_for("nemotron_h") is None


def test_rank_limits():
    assert max_rank("vllm") == 512 and capabilities("vllm").moe_rank == 128
    assert max_rank("hf") is None and max_rank("triton") is None


# harness/commands/metamorphic.py ENGINE_MODES before the facts moved here: engine -> mode -> options
MODES = {
    "hf": {f"experts_{i}": {"experts_impl": i} for i in ("eager", "batched_mm", "grouped_mm")},
    "triton": {
        "kernels_torch": {"impl": "torch"},
        "kernels_triton": {"impl": "triton"},
        "attention_sdpa": {"attention": "sdpa"},
        "attention_flash": {"attention": "flash"},
        "attention_triton": {"attention": "triton"},
    },
    "vllm": {
        "mixed_moe_lora_format": {"mixed_moe_lora_format": True},
        "cuda_graphs_on": {"llm_kwargs": {"enforce_eager": False}},
        "chunked_prefill_64": {"llm_kwargs": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}},
        "chunked_prefill_off": {"llm_kwargs": {"enable_chunked_prefill": False}},
    },
    "sglang": {
        "cuda_graphs_on": {"server_args": {"disable_cuda_graph": False}},
        "chunked_prefill_64": {"server_args": {"chunked_prefill_size": 64}},
        "lora_backend_csgmv": {"server_args": {"lora_backend": "csgmv"}},
    },
}


@pytest.mark.parametrize("engine", sorted(MODES))
def test_engine_modes_are_the_metamorphic_table(engine):
    assert {n: m.options for n, m in engine_modes(engine).items()} == MODES[engine]


def test_every_detectable_defect_has_a_doctor_detector():
    """A defect the adapter files can show is checked by doctor; the ones only a run shows (a TP size) are not."""
    from lpdiff.harness.pipeline.doctor_detectors import DETECTORS

    declared = {d.id: d for e in ENGINES for d in capabilities(e).known_defects}
    undetected = {i for i, d in declared.items() if i not in DETECTORS}
    assert undetected == {"vllm-moe-lora-tp4-fault"}
    assert all(declared[i].tp for i in undetected), "only a TP size hides a defect from the files"
    assert set(DETECTORS) <= set(declared), "a detector for a defect no engine declares"
    for d in declared.values():
        what, fix = d.message(
            arch="A",
            where="W",
            to_peft3d="C",
            to_per_expert="C",
            to_per_expert_gate="C",
            router_fix="F",
            error="E",
            router="",
            rank=1,
            limit=1,
            features="F",
            qkv="k_proj",
            parts="P",
            missing="M",
            to_root="C",
            differ=1,
            pattern="'x'",
            bad="B",
            supported="S",
        )
        assert what and fix and "{" not in what + fix, d.id  # every field a message names is one doctor fills


def test_hf_capture_layers_points():
    """The hf engine's capture: every point for every layer of an MoE model, the adapter's delta visible, and the
    base re-run equal to a capture without the adapter."""
    torch = pytest.importorskip("torch")
    from lpdiff.engines import EngineConfig, open_engine
    from lpdiff.harness.spec.resolve import resolve

    spec, adapters, prompts = resolve("tiny-qwen3-moe", ["experts"])
    n = min(len(p) for p in prompts[:2])
    prompts = [p[:n] for p in prompts[:2]]
    with open_engine("hf", EngineConfig(model=spec, adapters=adapters, options={"router_margins": False})) as eng:
        cap = eng.capture_layers(prompts, "experts")
        base = eng.capture_layers(prompts, None)
        with pytest.raises(ValueError, match="one length"):
            eng.capture_layers([prompts[0], prompts[1][:-1]], "experts")
    layers = sorted({i for i, _ in cap})
    assert layers == list(range(spec.num_layers or len(layers))) and layers
    assert {p for _, p in cap} == set(CAPTURE_POINTS)
    i = layers[0]
    assert cap[i, "hidden"].shape[0] == 2 * n and cap[i, "router_ids"].shape == cap[i, "router_weights"].shape
    assert not torch.equal(cap[i, "experts"], cap[i, "experts_base"])  # the expert adapter moves the experts
    torch.testing.assert_close(cap[i, "experts_base"], base[i, "experts"], rtol=0, atol=0)
    torch.testing.assert_close(cap[i, "attention_base"], base[i, "attention"], rtol=0, atol=0)


def test_adapter_roots():
    """vLLM maps Qwen3.5's adapter names through its multimodal class's checkpoint mapper: they must sit under
    ``model.language_model`` (the in-memory text arch reads the checkpoint's entry); SGLang reads the text model's
    names (its GPU check passes text-named files), and no other engine or arch has a root."""
    vllm = capabilities("vllm")
    assert vllm.adapter_root("qwen3_5_moe") == vllm.adapter_root("qwen3_5_moe_text") == "model.language_model"
    assert [vllm.adapter_root(a) for a in ("qwen3_moe", "gpt_oss", "nemotron_h", "qwen3")] == [None] * 4
    assert all(capabilities(e).adapter_root("qwen3_5_moe_text") is None for e in ENGINES if e != "vllm")
    d = vllm.defect("vllm-qwen3.5-text-names", "qwen3_5_moe_text")
    assert d.severity == "error" and d.when and "{to_root}" in d.fix and "qwen3_vl.py:1676" in d.what
    assert "peft3d" in layouts_for("vllm", "qwen3_5_moe_text")  # a condition on the names, not on the layout
