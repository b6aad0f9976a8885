"""engines/vllm/ without vLLM: prompt-logprob parsing, top-k mapping, rank slots, option checks. Runs in the main
virtualenv (no vLLM there) and again in the vLLM stage.

The ``Fake*`` classes below are stand-ins for vLLM's output types (``Logprob``, ``FlatLogprobs``), for parsing
tests only: they carry the same fields vLLM 0.25 (list of dicts) and 0.32 (flat lists) return. The real engine runs
against real vLLM in tests/engines/vllm/test_engine.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.vllm import (
    VLLMEngine,
    adapter_problems,
    default_attention_backend,
    parse_prompt_logprobs,
    pick_max_lora_rank,
    plan_moe_lora,
    renamed_per_expert_adapter,
    root_problems,
    vllm_native_3d,
    vllm_top_k,
)
from lpdiff.harness.types import AdapterSpec, ModelSpec
from tests.helpers.paths import REPO


@dataclass
class FakeLogprob:  # stand-in for vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeFlatLogprobs:  # stand-in for vllm.logprobs.FlatLogprobs (0.3x): same field names, flat lists
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def append_row(self, ids, lps):
        """Like vLLM's append_fast: the actual token first, then the top k, duplicates kept."""
        self.start_indices.append(len(self.logprobs))
        self.token_ids += list(ids)
        self.logprobs += list(lps)
        self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)


def vllm_like(token_ids, logits: np.ndarray, k: int, flat: bool):
    """What vLLM returns for prompt_logprobs=k: position 0 None, then the k best plus the actual token, ranked."""
    logz = np.log(np.exp(logits).sum(-1, keepdims=True))
    lp = logits - logz
    entries, fl = [None], FakeFlatLogprobs()
    fl.append_row([], [])
    for i in range(1, len(token_ids)):
        row = lp[i - 1]
        order = np.argsort(-row, kind="stable")
        ids = [int(token_ids[i]), *map(int, order[:k] if k != -1 else order)]  # actual token, then the top k
        fl.append_row(ids, [float(row[t]) for t in ids])
        # a dict merges the duplicate; parsing must not depend on dict order either
        entries.append({t: FakeLogprob(float(row[t])) for t in reversed(ids)})
    return (fl if flat else entries), lp


@pytest.mark.parametrize("flat", [False, True])  # 0.25 list of dicts / 0.32 FlatLogprobs
@pytest.mark.parametrize("k", [0, 3, -1])  # actual token only / top-k / whole vocabulary
def test_parse_matches_the_log_softmax_it_came_from(flat, k):
    g = np.random.default_rng(0)
    vocab, ids = 50, [3, 17, 17, 0, 49, 8]
    logits = g.normal(size=(len(ids) - 1, vocab)) * 3
    entries, lp = vllm_like(ids, logits, k, flat)
    got = parse_prompt_logprobs(ids, entries, top_k=k)
    want = lp[np.arange(len(ids) - 1), ids[1:]]
    assert got.logprobs.dtype == np.float32 and np.allclose(got.logprobs, want, atol=1e-6)
    assert got.token_ids.tolist() == ids
    if k == 0:
        assert got.topk_ids is None
        return
    kk = vocab if k == -1 else k
    best = np.argsort(-lp, axis=1, kind="stable")[:, :kk]
    assert got.topk_ids.shape == (len(ids) - 1, kk)
    assert np.array_equal(got.topk_ids, best)
    assert np.allclose(got.topk_logprobs, np.take_along_axis(lp, best, 1), atol=1e-6)


def test_actual_token_outside_topk_is_not_mistaken_for_topk():
    # token 9 is the actual token but ranks 40th: it is in the dict, it must not enter the top 2
    entries = [None, {9: FakeLogprob(-6.0, 40), 1: FakeLogprob(-0.1, 1), 2: FakeLogprob(-2.5, 2)}]
    got = parse_prompt_logprobs([5, 9], entries, top_k=2)
    assert got.logprobs.tolist() == [-6.0] and got.topk_ids.tolist() == [[1, 2]]


@pytest.mark.parametrize(
    "entries, ids, match",
    [
        ([None, {1: FakeLogprob(-1.0)}], [5, 9], "lack the actual token 9"),  # a wrong entry must not pass silently
        ([None], [5, 9], "for 1 positions, the prompt has 2"),  # length mismatch
        (None, [5, 9], "prompt_logprobs=k"),  # the request forgot prompt logprobs
    ],
)
def test_parse_errors_name_the_problem(entries, ids, match):
    with pytest.raises(ValueError, match=match):
        parse_prompt_logprobs(ids, entries)


def test_parse_refuses_short_topk():
    entries = [None, {9: FakeLogprob(-0.5, 1), 1: FakeLogprob(-1.5, 2)}]
    with pytest.raises(ValueError, match="asked for top 5 logprobs, vLLM returned 2"):
        parse_prompt_logprobs([5, 9], entries, top_k=5)


@pytest.mark.parametrize(
    "top_k, vocab, want",
    [
        (0, 100, 0),  # actual token only
        (5, 100, 5),
        (-1, 100, -1),  # whole vocabulary, vLLM's spelling
        (100, 100, -1),  # k >= vocab is the whole vocabulary (HF engine spelling)
    ],
)
def test_vllm_top_k(top_k, vocab, want):
    assert vllm_top_k(top_k, vocab) == want


def test_vllm_top_k_refuses_negative():
    with pytest.raises(ValueError, match="top_k must be -1"):
        vllm_top_k(-2, 10)


@pytest.mark.parametrize(
    "ranks, want",
    [
        ([8], 8),
        ([4, 8], 8),  # a rank-4 adapter shares the rank-8 slots
        ([9], 16),  # not an allowed value: next one up
        ([320], 320),
    ],
)
def test_pick_max_lora_rank(ranks, want):
    assert pick_max_lora_rank(ranks) == want


def test_pick_max_lora_rank_too_big_names_the_fix():
    with pytest.raises(ValueError, match="exceeds vLLM's largest max_lora_rank 512"):
        pick_max_lora_rank([1024])


def test_adapter_max_rank_reads_rank_pattern(tmp_path):
    import json

    from safetensors.numpy import save_file

    from lpdiff.harness.spec.adapters import adapter_max_rank

    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["q_proj"],
                "rank_pattern": {"q_proj": 32},
            }
        )
    )
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((32, 4), np.float32)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    assert adapter_max_rank(tmp_path) == 32


def test_unknown_option_is_refused_with_the_known_ones():
    cfg = EngineConfig(model=ModelSpec(name="m", arch="qwen3", path="/nonexistent"), options={"max_lora": 2})
    with pytest.raises(ValueError, match=r"unknown vllm engine options \['max_lora'\].*max_loras"):
        VLLMEngine(cfg)


def test_engine_outside_with_block_says_how_to_use_it():
    eng = VLLMEngine(
        EngineConfig(
            model=ModelSpec(name="m", arch="qwen3", path="/nonexistent"), adapters={"a": AdapterSpec("a", "/x")}
        )
    )
    with pytest.raises(RuntimeError, match="context manager"):
        eng.prompt_logprobs([[1, 2]])


def test_checkpoint_dir_writes_a_layer_cut_model_once(tmp_path):
    # vLLM and SGLang load directories only: a spec cut to num_layers is written out, and loads as the same model
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.engines.vllm import checkpoint_dir
    from lpdiff.harness.build.zoo import TINY_CONFIGS
    from lpdiff.harness.spec.catalog import load_hf_model

    kw = dict(TINY_CONFIGS["tiny-qwen3-dense"], initializer_range=0.25)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).save_pretrained(
        str(tmp_path / "m")
    )
    full = ModelSpec(name="m", arch="qwen3", path=str(tmp_path / "m"))
    assert checkpoint_dir(full, tmp_path / "cache") == full.path  # nothing to write
    cut = ModelSpec(name="m", arch="qwen3", path=full.path, num_layers=2)
    out = checkpoint_dir(cut, tmp_path / "cache")
    assert checkpoint_dir(cut, tmp_path / "cache") == out and len(list((tmp_path / "cache").iterdir())) == 1
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        want = load_hf_model(cut, torch.float32, "cpu")(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 2 and torch.equal(got, want)


# -- vLLM 0.25.1's MoE-LoRA modes (what its source does: engines/vllm/adapters.py module docstring) ----------------

GPT_OSS, QWEN3 = "GptOssForCausalLM", "Qwen3MoeForCausalLM"


@pytest.mark.parametrize(
    "arch, native_3d, layouts, forced, mixed, rename",
    [
        (QWEN3, False, ["per_expert"], None, False, {}),  # Qwen3-MoE reads per-expert adapters natively
        (QWEN3, False, ["peft3d", "per_expert", "dense_only"], None, True, {}),  # 3D there needs the 2D conversion
        (QWEN3, False, ["dense_only"], None, False, {}),  # attention-only adapters: no MoE-LoRA mode at all
        (GPT_OSS, True, ["peft3d", "dense_only"], None, False, {}),  # gpt-oss 3D natively: the interleave-aware wrapper
        # asked for: vLLM's 2D path, per-expert names renamed to what GptOssModel.get_expert_mapping says
        (GPT_OSS, True, ["peft3d", "per_expert"], True, True, {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}),
        ("Qwen3_5MoeForConditionalGeneration", True, ["per_expert"], None, True, {}),  # 3D-native, concatenated: fine
    ],
)
def test_plan_moe_lora(arch, native_3d, layouts, forced, mixed, rename):
    plan = plan_moe_lora(arch, layouts, native_3d, forced)
    assert (plan.mixed, plan.rename) == (mixed, rename)
    # the only known-wrong path is gpt-oss's expert LoRA under the 2D wrapper, and it must say so
    assert bool(plan.known_defects) == (arch == GPT_OSS and mixed)


def test_plan_refuses_gpt_oss_per_expert_by_default_naming_both_ways_out():
    with pytest.raises(ValueError, match=r"interleaved.*convert --to peft3d.*mixed_moe_lora_format=True"):
        plan_moe_lora(GPT_OSS, ["peft3d", "per_expert"], True)


@pytest.mark.parametrize(
    "arch, native_3d, layout, fix",
    [
        (QWEN3, False, "peft3d", "--to per_expert"),  # forced off: vLLM would crash at set_lora (fused_moe.py:363)
        (GPT_OSS, True, "per_expert", "--to peft3d"),  # forced off: vLLM refuses the names as unexpected modules
    ],
)
def test_plan_refuses_a_layout_the_model_cannot_read_when_forced_off(arch, native_3d, layout, fix):
    with pytest.raises(ValueError, match=fix):
        plan_moe_lora(arch, [layout], native_3d, forced=False)


def test_native_3d_table_matches_vllm_0_25_1_without_vllm():
    pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM installed: its registry answers instead of the table")
    assert vllm_native_3d(GPT_OSS) and not vllm_native_3d(QWEN3)


def _adapter_dir(tmp_path, keys_shapes: dict, **cfg) -> Path:
    import json

    from safetensors.numpy import save_file

    d = tmp_path / "a"
    d.mkdir(exist_ok=True)
    (d / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["gate_proj", "up_proj", "down_proj"],
                **cfg,
            }
        )
    )
    save_file(
        {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in keys_shapes.items()},
        str(d / "adapter_model.safetensors"),
    )
    return d


P = "base_model.model.model.layers.0.mlp.experts"


def _per_expert(parts=("gate_proj", "up_proj", "down_proj"), experts=2):
    return {
        f"{P}.{e}.{part}.lora_{ab}.weight": (2, 3) if ab == "A" else (3, 2)
        for e in range(experts)
        for part in parts
        for ab in "AB"
    }


@pytest.mark.parametrize(
    "keys, cfg, match",
    [
        ({f"{P}.lora_A.weight": (4, 3), f"{P}.lora_B.weight": (6, 4)}, {}, "one expert parameter"),  # lone gate_up
        ({k: s for k, s in _per_expert().items() if ".1.up_proj" not in k}, {}, r"experts\.1 has"),  # missing part
        (_per_expert(), {"rank_pattern": {"down_proj": 4}}, "rank_pattern"),  # vLLM scales every module alpha/r
    ],
)
def test_adapter_problems_name_what_vllm_would_misread(tmp_path, keys, cfg, match):
    from lpdiff.harness.spec.adapters import inspect_adapter

    problems = adapter_problems(inspect_adapter(_adapter_dir(tmp_path, keys, **cfg)))
    assert len(problems) == 1 and re.search(match, problems[0])


def test_adapter_problems_accept_what_vllm_reads(tmp_path):
    from lpdiff.harness.spec.adapters import inspect_adapter

    both = {
        f"{P}.base_layer.lora_A.weight": (4, 3),
        f"{P}.base_layer.lora_B.weight": (6, 4),
        f"{P}.lora_A.weight": (4, 3),
        f"{P}.lora_B.weight": (3, 4),
    }
    assert adapter_problems(inspect_adapter(_adapter_dir(tmp_path, both))) == []
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    assert adapter_problems(inspect_adapter(_adapter_dir(tmp_path, _per_expert()))) == []
    # Nemotron's relu2 experts have no gate_proj
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    info = inspect_adapter(_adapter_dir(tmp_path, _per_expert(("up_proj", "down_proj"))))
    assert adapter_problems(info, gated=False) == [] and len(adapter_problems(info)) == 1


def test_renamed_per_expert_adapter_keeps_every_tensor_under_vllms_names(tmp_path):
    from safetensors.numpy import load_file

    src = _adapter_dir(
        tmp_path, {**_per_expert(), "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (2, 3)}
    )
    rename = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    out = renamed_per_expert_adapter(src, rename, tmp_path / "cache")
    assert renamed_per_expert_adapter(src, rename, tmp_path / "cache") == out  # written once
    old, new = load_file(str(src / "adapter_model.safetensors")), load_file(f"{out}/adapter_model.safetensors")
    assert len(new) == len(old)
    for k, v in old.items():
        m = re.search(r"\.experts\.\d+\.(\w+)\.", k)
        k2 = k.replace(f".{m.group(1)}.", f".{rename[m.group(1)]}.") if m else k  # attention keys stay
        assert np.array_equal(new[k2], v), k
    import json

    assert json.loads(Path(out, "adapter_config.json").read_text())["target_modules"] == ["w1", "w2", "w3"]


@pytest.mark.parametrize(
    "dtype, backend",
    [
        ("bfloat16", "FLASH_ATTN"),  # what ran MoE-LoRA on 0.25.1 (FA3 has gpt-oss's sinks)
        ("float32", "TRITON_ATTN"),  # FlashAttention has no fp32 (flash_attn.py:68)
    ],
)
def test_default_attention_backend(dtype, backend):
    assert default_attention_backend(dtype) == backend


def test_reap_waits_for_what_started_during_construction_and_kills_the_hung():
    import subprocess
    import sys

    from lpdiff.engines.vllm import _children, reap

    before = set(_children())
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    mine = [p for pid, p in _children().items() if pid not in before]
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # someone else's: untouched
    t0 = time.monotonic()
    try:
        killed = reap(mine, timeout_s=3)
        # the finished one was waited for, the hung one killed at the deadline (psutil reaps both: no exit codes)
        assert killed == [hung.pid] and 3 <= time.monotonic() - t0 < 15
        assert later.poll() is None
    finally:
        later.kill()
        later.wait(5)
    for p in (quick, hung):
        p.wait(5)
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


@pytest.mark.parametrize("layout", ["peft3d", "per_expert"])
def test_engine_lora_setup_on_the_zoo_gpt_oss(tmp_path, layout):
    # the wiring from real adapter files to vLLM's flags, without vLLM: 3D gets the native wrapper (no mixed
    # format), per-expert is refused before anything starts
    pytest.importorskip("torch")
    from lpdiff.harness.spec.adapters import convert_adapter
    from lpdiff.harness.spec.catalog import get_model, hf_config

    spec = get_model("tiny-gpt-oss")
    src = REPO / "harness" / "zoo_adapters" / "tiny-gpt-oss" / "all"
    path = src if layout == "peft3d" else convert_adapter(src, tmp_path / "pe", "per_expert", hf_config(spec)).path
    eng = VLLMEngine(EngineConfig(model=spec, adapters={"a": AdapterSpec("a", str(path))}, dtype="bfloat16"))
    if layout == "per_expert":
        with pytest.raises(ValueError, match="interleaved"):
            eng._lora_kwargs(hf_config(spec), on_cpu=False, known={"enable_mixed_moe_lora_format"})
        return
    kw = eng._lora_kwargs(hf_config(spec), on_cpu=False, known={"enable_mixed_moe_lora_format"})
    assert kw["enable_lora"] and "enable_mixed_moe_lora_format" not in kw and not eng._mixed


def test_close_does_not_wait_for_the_resource_tracker():
    # spawning (as vLLM's engine core is) starts multiprocessing's resource tracker, which lives as long as this
    # process: closing an engine must not wait for it (it did, ~60 s per engine on an H200). Checked in a fresh
    # interpreter (a test worker may already hold a tracker started elsewhere), and once the tracker has exec'd:
    # just after the semaphore its /proc cmdline can still be empty (seen: CI failed "no resource tracker started")
    import subprocess
    import sys

    script = """
import json, multiprocessing as mp, time, psutil
from lpdiff.engines.vllm import _children
mp.get_context("spawn").Semaphore()  # the tracker starts with the first named semaphore
for _ in range(200):
    trackers = [p.pid for p in psutil.Process().children(recursive=True) if "resource_tracker" in " ".join(p.cmdline())]
    if trackers:
        break
    time.sleep(0.05)
print(json.dumps([trackers, sorted(_children())]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    trackers, children = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert trackers, "no resource tracker started: the test does not test anything"
    assert not set(trackers) & set(children)


def test_text_named_qwen35_adapters_are_refused_before_start_naming_the_fix(tmp_path):
    """vLLM 0.25.1 maps Qwen3.5's adapter names through its multimodal class's checkpoint mapper and drops modules
    named like the text model without a word (measured: every lane equal to the base model, H200): the engine
    refuses them before any process starts, with the command that writes them under the checkpoint's root."""
    pytest.importorskip("transformers")
    from lpdiff.harness.spec.adapters import convert_adapter, inspect_adapter
    from lpdiff.harness.spec.catalog import get_model, hf_config
    from lpdiff.harness.spec.resolve import zoo_adapters

    spec = get_model("tiny-qwen3.5-moe")
    hf, src = hf_config(spec), str(zoo_adapters("tiny-qwen3.5-moe")["all"].path)
    rooted = convert_adapter(src, tmp_path / "rooted", "peft3d", hf, disk_root="model.language_model").path
    got = root_problems({"all": inspect_adapter(src)}, hf.model_type, "M")
    assert len(got) == 1 and "silently drops" in got[0] and "qwen3_vl.py:1676" in got[0]
    assert got[0].endswith(f"lpdiff adapters convert --model M {src} OUT --to peft3d --disk-root model.language_model")
    assert root_problems({"all": inspect_adapter(rooted)}, hf.model_type, "M") == []
    assert root_problems({"all": inspect_adapter(src)}, "qwen3_moe", "M") == []  # no root there: text names are right
    eng = VLLMEngine(EngineConfig(model=spec, adapters={"all": AdapterSpec("all", src)}, dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"(?s)silently drop these adapters.*'all'.*--disk-root model\.language_model"):
        eng._lora_kwargs(hf, on_cpu=False, known=set())  # the step of _llm_kwargs that needs no vLLM


def test_qwen35_peft3d_adapters_take_the_native_3d_path_of_the_checkpoints_class(tmp_path):
    """The MoE-LoRA plan asks about the class vLLM builds, named by the checkpoint's config.json: the catalog's
    Qwen3.5 text config names no architecture, and planning on "" put the natively-3D wrapper class on the mixed
    format for its PEFT 3D files."""
    pytest.importorskip("transformers")
    from lpdiff.harness.spec.adapters import convert_adapter
    from lpdiff.harness.spec.catalog import get_model, hf_config
    from lpdiff.harness.spec.resolve import zoo_adapters

    spec = get_model("qwen3.5-35b-a3b", num_layers=4)
    assert not hf_config(spec).architectures  # the case this test is about
    src = str(zoo_adapters("tiny-qwen3.5-moe")["all"].path)
    tiny = hf_config(get_model("tiny-qwen3.5-moe"))
    rooted = convert_adapter(src, tmp_path / "rooted", "peft3d", tiny, disk_root="model.language_model").path
    eng = VLLMEngine(EngineConfig(model=spec, adapters={"all": AdapterSpec("all", str(rooted))}, dtype="bfloat16"))
    kw = eng._lora_kwargs(hf_config(spec), on_cpu=False, known={"enable_mixed_moe_lora_format"})
    assert kw["enable_lora"] and "enable_mixed_moe_lora_format" not in kw and not eng._mixed


def test_nemotron_lora_steps_are_capped_where_vllm_runs_them(tmp_path):
    """vLLM 0.25.1's Nemotron-H MoE-LoRA engine died (illegal memory access) where tokens per step x TP reached
    8192 (8192 at TP 1, 4096 at TP 2, 2048 at TP 4) and ran at 4096 / TP (H200, H100): the engine asks for 2048-token
    steps at TP 1 and 2 and 4096 / TP above, on that arch only."""
    pytest.importorskip("transformers")
    from lpdiff.engines.vllm.settings import nemotron_step_tokens
    from lpdiff.harness.spec.catalog import get_model, hf_config
    from lpdiff.harness.spec.resolve import zoo_adapters

    known = {"enable_mixed_moe_lora_format", "max_num_batched_tokens"}
    got = {}
    for model, name in (("tiny-nemotron-h", "attention"), ("tiny-qwen3-moe", "attention")):
        spec = get_model(model)
        adapters = {"a": AdapterSpec("a", str(zoo_adapters(model)[name].path))}
        for tp in (1, 2, 4, 8):
            eng = VLLMEngine(EngineConfig(model=spec, adapters=adapters, dtype="bfloat16", tp=tp))
            got[model, tp] = eng._lora_kwargs(hf_config(spec), on_cpu=False, known=known).get("max_num_batched_tokens")
    assert got == {
        **{("tiny-nemotron-h", tp): n for tp, n in ((1, 2048), (2, 2048), (4, 1024), (8, 512))},
        **{("tiny-qwen3-moe", tp): None for tp in (1, 2, 4, 8)},
    }
    assert [nemotron_step_tokens(tp) for tp in (1, 2, 4, 8)] == [2048, 2048, 1024, 512]
