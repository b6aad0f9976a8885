"""The validation layer itself (harness/spec/validate/) and the engines using it: hf and triton refuse the same bad
prompts with the same message, and check adapters before loading them (triton: rank vs r, router LoRA)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lpdiff.engines import EngineConfig, open_engine
from lpdiff.harness.spec import validate
from lpdiff.harness.spec.catalog import get_model
from lpdiff.harness.spec.resolve import zoo_adapters
from lpdiff.harness.spec.validate import ValidationError
from lpdiff.harness.spec.validate.adapters import adapter_problems, model_facts
from lpdiff.harness.spec.validate.prompts import check_prompt_arrays, check_prompts
from lpdiff.harness.spec.validate.runs import LOGPROB_TOL, check_run
from lpdiff.harness.types import AdapterSpec, LogprobRun, PromptLogprobs

MODEL = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def engines():
    spec = get_model(MODEL)
    with (
        open_engine("hf", EngineConfig(model=spec, device="cpu")) as hf,
        open_engine("triton", EngineConfig(model=spec, device="cpu")) as triton,
    ):
        yield {"hf": hf, "triton": triton}


@pytest.mark.parametrize(
    "prompts, needle",
    [
        ([], "no prompts"),
        ([[1, 2, 3], [4, 1024, 5]], "prompt 1 has 1 token id(s) outside the vocabulary [0, 1024) (e.g. 1024)"),
        ([[1, -3, 2]], "outside the vocabulary [0, 1024) (e.g. -3)"),
        ([[1, 2.5, 3]], "float values"),
        ([[7]], "prompt 0 has 1 token(s)"),
        ([[1] * 1025], "more than the model's max_position_embeddings (1024)"),
        ([[1, 2], (3, True, 4)], "prompt 1 holds booleans"),
    ],
    ids=["empty-list", "out-of-vocab", "negative", "float", "one-token", "too-long", "bool"],
)
def test_engines_refuse_bad_prompts_alike(engines, prompts, needle):
    said = {}
    for name, eng in engines.items():
        with pytest.raises(ValidationError) as e:
            eng.prompt_logprobs(prompts)
        said[name] = str(e.value)
    assert said["hf"] == said["triton"] and needle in said["hf"] and said["hf"].startswith("prompts for tiny-qwen3-moe")


def test_engines_accept_numpy_and_torch_ids(engines):
    p = [np.array([3, 9, 27], dtype=np.int32), torch.tensor([5, 7, 11, 13])]
    for eng in engines.values():
        assert [len(r.logprobs) for r in eng.prompt_logprobs(p)] == [2, 3]


def test_prompts_truncate_only_when_asked():
    with pytest.raises(ValidationError, match="shorten it or pass --truncate-prompts"):
        check_prompts([[1] * 10], 100, 8, source="x", hint="--truncate-prompts")
    assert check_prompts([[1] * 10, [2, 3]], 100, 8, truncate=True) == [[1] * 8, [2, 3]]


def test_prompt_arrays_are_the_checked_ids():
    """The triton engine takes the checked prompts as int64 arrays (check_prompt_arrays) and packs them with one
    concatenate: the same ids as the int lists check_prompts gives, packed the same way, whatever came in."""
    from lpdiff.engines.triton.batch import Batch

    rng = np.random.default_rng()
    raw = [rng.integers(0, 100, size=int(n)).tolist() for n in rng.integers(2, 40, size=5)] + [
        np.array([4, 5, 6], dtype=np.uint8),
        torch.tensor([7, 8]),
        (9, 10, 11),
    ]
    arrays, lists = check_prompt_arrays(raw, 100, 30, truncate=True), check_prompts(raw, 100, 30, truncate=True)
    assert all(a.dtype == np.int64 for a in arrays) and [a.tolist() for a in arrays] == lists
    assert all(len(p) <= 30 for p in lists) and all(type(x) is int for p in lists for x in p)
    packed = Batch.token_ids(arrays)
    assert packed.dtype == np.int64 and np.array_equal(packed, Batch.token_ids(lists))
    assert packed.tolist() == [x for p in lists for x in p]


def _copy(tmp_path, name="attention"):
    d = tmp_path / name
    shutil.copytree(zoo_adapters(MODEL)[name].path, d)
    return d


def _rank_4_under_r_8(d):
    path = d / "adapter_model.safetensors"
    t = load_file(str(path))
    save_file({k: v[:4].contiguous() if ".lora_A." in k else v[:, :4].contiguous() for k, v in t.items()}, str(path))
    return d


def _router(d):
    """A qwen3_moe adapter with LoRA on layer 0's router (as PEFT saves one for target_modules=['gate'])."""
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": [*cfg["target_modules"], "gate"]}))
    path = d / "adapter_model.safetensors"
    t = load_file(str(path))
    p = "base_model.model.model.layers.0.mlp.gate"
    t[f"{p}.lora_A.weight"], t[f"{p}.lora_B.weight"] = torch.zeros(8, 128), torch.zeros(8, 8)
    save_file(t, str(path))
    return d


@pytest.mark.parametrize("engine", ["hf", "triton"])
def test_engines_refuse_rank_that_differs_from_r(tmp_path, engine):
    bad = _rank_4_under_r_8(_copy(tmp_path))
    cfg = EngineConfig(model=get_model(MODEL), adapters={"a": AdapterSpec("a", str(bad))}, device="cpu")
    with pytest.raises(ValidationError, match=r"has rank 4 but adapter_config.json says r=8"):
        open_engine(engine, cfg).__enter__()


def test_router_adapter_refused_by_triton_for_the_router(tmp_path):
    bad = _router(_copy(tmp_path))
    cfg = EngineConfig(model=get_model(MODEL), adapters={"a": AdapterSpec("a", str(bad))}, device="cpu")
    with pytest.raises(
        ValidationError,
        match=r"LoRA on the MoE router \(model.layers.0.mlp.gate\), which the triton "
        "engine refuses",
    ):
        open_engine("triton", cfg).__enter__()
    # the engine-independent checks pass it: PEFT (hf) decides about routers itself
    assert not [p for p in adapter_problems(bad, model_facts(get_model(MODEL))) if p.severity == "error"]


def test_every_zoo_adapter_is_clean():
    for model in ("tiny-qwen3-moe", "tiny-gpt-oss", "tiny-qwen3.5-moe", "tiny-nemotron-h"):
        facts = model_facts(get_model(model))
        for name, a in zoo_adapters(model).items():
            assert adapter_problems(a.path, facts, router_lora="refused") == [], (model, name)


def test_depth_cut_model_skips_deeper_layers_tensors():
    a = zoo_adapters(MODEL)["all"].path
    assert adapter_problems(a, model_facts(get_model(MODEL, num_layers=1)), num_layers=1) == []


def test_logprob_rounding_above_zero_is_tolerated():
    def run(v):
        return LogprobRun([PromptLogprobs(np.array([1, 2, 3]), np.array([-1.0, v], np.float32))])

    check_run(run(LOGPROB_TOL / 2), "r")
    with pytest.raises(ValidationError, match="above 0"):
        check_run(run(LOGPROB_TOL * 2), "r")


def test_the_face_hands_out_the_submodules_objects():
    """``lpdiff.harness.spec.validate`` loads adapters / prompts / runs on first use (PEP 562): the names it gives
    are those modules' own objects, and an unknown name is an AttributeError."""
    from lpdiff.harness.spec.validate import adapters, prompts, runs

    assert validate.check_run is runs.check_run and validate.check_prompts is prompts.check_prompts
    assert validate.adapter_problems is adapters.adapter_problems and validate.LOGPROB_TOL == runs.LOGPROB_TOL
    with pytest.raises(AttributeError):
        validate.no_such_check  # noqa: B018


def test_prompt_arrays_from_int_lists_keep_every_refusal():
    """Plain int lists take numpy's fromiter (2.6x asarray's speed); what asarray's path refused or kept is the same:
    floats and booleans refused, ids past int64 kept exact (object) and named by the vocabulary check, numpy ints and
    tuples read as ints."""
    check = validate.check_prompt_arrays
    got = check([[5, 7, 9], (1, 2), [np.int32(3), np.int32(4)]], 10)
    assert [a.tolist() for a in got] == [[5, 7, 9], [1, 2], [3, 4]] and all(a.dtype == np.int64 for a in got)
    with pytest.raises(ValidationError, match="holds float values"):
        check([[1, 2.0, 3]], 10)
    with pytest.raises(ValidationError, match="holds booleans"):
        check([[1, True, 3]], 10)
    with pytest.raises(ValidationError, match=r"outside the vocabulary \[0, 10\) \(e.g. 1180591620717411303424\)"):
        check([[1, 2**70]], 10)
    assert check([[1, 2**70]], None)[0].tolist() == [1, 2**70]
