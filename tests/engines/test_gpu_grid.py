"""suites/test_engines_gpu.py's grid, on CPU: which cases `-m gpuN` selects, and the reason each one an engine
cannot serve gives when it skips."""

import importlib.util

import pytest

from tests.helpers.paths import REPO

_spec = importlib.util.spec_from_file_location("engines_gpu_grid", REPO / "suites" / "test_engines_gpu.py")
grid_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grid_module)


def test_every_model_engine_and_dtype_at_every_tp_size_carries_its_gpu_mark():
    cases = {}
    for p in grid_module.grid():
        model, engine, tp, dtype = p.values
        assert [m.name for m in p.marks] == [f"gpu{tp}"], p.id
        assert p.id.endswith({"bfloat16": "-bf16", "float32": "-fp32"}[dtype]), p.id
        cases.setdefault(tp, set()).add((model, engine, dtype))
    every = {(m, e, d) for m in grid_module.MODELS for e in grid_module.ENGINES for d in grid_module.DTYPES.values()}
    assert set(cases) == {1, 2, 4, 8}
    assert all(cases[tp] == every for tp in cases)
    assert {m for m, _, _ in every} == {
        "qwen3-30b-a3b",
        "gpt-oss-20b",
        "qwen3.5-35b-a3b",
        "nemotron-3-nano-30b-a3b",
        "nemotron-3-super-120b-a12b",
    }


@pytest.mark.parametrize(
    "engine,model,tp,dtype,why",
    [
        ("triton", "qwen3-30b-a3b", 4, "float32", None),
        ("triton", "gpt-oss-20b", 8, "bfloat16", None),
        ("sglang", "nemotron-3-nano-30b-a3b", 4, "bfloat16", None),
        ("vllm", "qwen3.5-35b-a3b", 2, "bfloat16", None),
        ("hf", "qwen3.5-35b-a3b", 1, "bfloat16", None),  # HF's own bf16 rounding, judged like an engine
        ("vllm", "qwen3-30b-a3b", 1, "float32", "vLLM has no float32 LoRA path"),
        ("sglang", "gpt-oss-20b", 2, "float32", "SGLang has no float32 LoRA path"),
        ("triton", "nemotron-3-super-120b-a12b", 1, "bfloat16", None),
        ("hf", "gpt-oss-20b", 2, "bfloat16", "runs TP 1 only"),
        ("hf", "gpt-oss-20b", 1, "float32", "is the reference itself"),
    ],
)
def test_a_case_an_engine_cannot_serve_skips_with_the_reason(engine, model, tp, dtype, why):
    got = grid_module.cannot_serve(engine, model, tp, dtype)
    assert got is None if why is None else why in got, got


def test_declared_tp_defects_decide_which_outcomes_a_case_accepts(tmp_path_factory):
    """The grid's rule on real check results of the tiny zoo (CPU): with no defect every lane must be as expected;
    a declared error must come out not as expected; a declared warning (the engine may die) takes a run as expected
    or the engine's own error, never lanes that come out wrong without one."""
    import dataclasses

    from lpdiff.engines.base import capabilities
    from lpdiff.harness.commands import check
    from lpdiff.harness.pipeline.store import BaselineStore

    case = check.build_case(
        "tiny-qwen3-moe", 2, tmp_path_factory.mktemp("case"), device="cpu", lengths=(40, 27), log=lambda s: None
    )
    store = BaselineStore(tmp_path_factory.mktemp("store"))
    run = dict(store=store, log=lambda s: None)
    served = check.run_check(check.CheckRequest(case, "triton", k=2, dtype="float32"), **run)
    wrong = check.run_check(
        check.CheckRequest(case, "triton", k=2, dtype="float32", options={"fault": "topk_weight_missing"}), **run
    )
    died = check.run_check(
        check.CheckRequest(case, "hf", tp=2, k=2), **run
    )  # the hf engine refuses TP: an engine error
    assert served.as_expected and not wrong.as_expected and wrong.error is None and died.error is not None
    may = capabilities("vllm").defect("vllm-moe-lora-tp4-fault", "qwen3_moe")
    assert may.severity == "warning" and may.tp == (4,)
    must = dataclasses.replace(may, severity="error")
    outcome = grid_module.outcome
    assert outcome([served], []) is None
    assert "expected" in outcome([wrong], []) and "engine failed" in outcome([died], [])
    assert outcome([served], [may]) is None and outcome([served, died], [may]) is None
    assert "lanes came out wrong without one" in outcome([wrong], [may])
    assert "no longer reproduced" in outcome([served], [must])
    assert outcome([died], [must]) is None and outcome([wrong], [must]) is None


def test_k_dtype_selects_that_dtype_only():
    """`-k fp32` picks the fp32 cases: no test name in the suite holds a dtype tag."""
    names = [n for n in dir(grid_module) if n.startswith("test_")]
    assert names and not [n for n in names if any(tag in n for tag in grid_module.DTYPES)], names


def assert_every_cell_at_tp_1_and_2(params, suffix: str) -> None:
    """A further grid (trainer, neutrality): every model x engine x dtype at TP 1 and 2, each marked gpuN, ids
    ending ``suffix``."""
    ids = set()
    for p in params:
        model, engine, tp, dtype = p.values
        assert [m.name for m in p.marks] == [f"gpu{tp}"] and p.id.endswith(suffix), p.id
        ids.add((model, engine, tp, dtype))
    assert ids == {
        (m, e, tp, d)
        for m in grid_module.MODELS
        for e in grid_module.ENGINES
        for tp in (1, 2)
        for d in grid_module.DTYPES.values()
    }


def test_trainer_lanes_carry_their_gpu_mark_at_tp_1_and_2():
    assert_every_cell_at_tp_1_and_2(grid_module.trainer_grid(), "-trainer")


def test_trainer_lanes_on_cpu_refused_with_each_engines_reason_and_judged_on_triton(tmp_path_factory):
    """check.trainer_plans_for on the tiny zoo (CPU): doctor refuses, per engine, exactly the lanes that engine
    cannot run (vLLM 0.25.1: rank/alpha patterns, expert rank > 128, lm_head LoRA; SGLang: rsLoRA and patterns), and
    the triton runtime in fp32 serves every lane beside base rows in one batch: each correct lane PASSes, "broken"
    FAILs."""
    import dataclasses

    from lpdiff.harness.commands import check
    from lpdiff.harness.pipeline.store import BaselineStore

    plans = check.trainer_plans_for("qwen3_moe")
    case = check.build_case(
        "tiny-qwen3-moe",
        2,
        tmp_path_factory.mktemp("trainer"),
        plans=plans,
        device="cpu",
        lengths=(40, 27),
        log=lambda s: None,
    )
    from lpdiff.engines.base import layouts_for

    refused = {
        e: {
            lane.split(".")[0]: why
            for lane, why in check.refused_lanes(
                case, e, check.served_files(case, e, layouts_for(e, "qwen3_moe"))
            ).items()
        }
        for e in ("vllm", "sglang")
    }
    assert {"rslora_patterns", "rank256", "vocab"} <= set(refused["vllm"]) and not {"rank128", "embed"} & set(
        refused["vllm"]
    )
    assert refused["vllm"]["rslora_patterns"].startswith(("vllm-ignores-patterns", "vllm-per-expert-rslora"))
    assert refused["vllm"]["rank256"].startswith("moe-rank-above-128")
    assert refused["vllm"]["vocab"].startswith("vllm-lm-head-prompt-logprobs")
    assert {"rslora_patterns", "all_vocab"} <= set(refused["sglang"]) and "rank128" not in refused["sglang"]
    assert all(
        why.startswith("sglang-ignores-scaling")
        for a, why in refused["sglang"].items()
        if a in ("rslora_patterns", "all_vocab")
    )
    # judged: the lanes whose math is new here (rank 128 / 256 parity: tests/harness/build/test_trainer_adapters.py, and
    # the kernels' own rank tests), to keep this CPU test short
    keep = {"all", "broken", "rslora_patterns", "vocab"}
    case = dataclasses.replace(
        case,
        plans={n: p for n, p in case.plans.items() if n in keep},
        files={k: v for k, v in case.files.items() if k[0] in keep},
    )
    res = check.run_check(
        check.CheckRequest(case, "triton", dtype="float32", k=2),
        store=BaselineStore(tmp_path_factory.mktemp("s")),
        log=lambda s: None,
    )
    assert res.error is None and not res.refused
    assert {v.adapter.split(".")[0] for v in res.verdicts} == keep | {"base"}
    assert res.as_expected, check.format_result(res)


def test_decode_lanes_run_at_tp_1_for_every_engine_dtype_and_sampling():
    got = {(p.values, tuple(m.name for m in p.marks)) for p in grid_module.decode_grid()}
    want = {
        ((m, e, d, s), ("gpu1",))
        for m in grid_module.MODELS
        for e in grid_module.ENGINES
        for d in grid_module.DTYPES.values()
        for s in ("greedy", "seeded")
    }
    assert got == want
    assert all(p.id.endswith(("-decode-greedy", "-decode-seeded")) for p in grid_module.decode_grid())


def test_the_grid_prompts_cross_every_engines_prefill_step_within_the_models_length():
    """grid_prompts (prompts.rl_prompts): per model, one prompt longer than the step every engine serving it runs
    with in the grid (vLLM's max_num_batched_tokens 16384 on an H200, SGLang's chunked_prefill_size 8192, triton /
    HF max_batch_tokens 8192, each capped at GRID_MAX_STEP 4096), short ones beside, none past
    max_position_embeddings; engines whose own step is above the cap get it as their step option."""
    from lpdiff.engines.base import capabilities
    from lpdiff.harness.spec.catalog import get_model, hf_config

    for model in grid_module.MODELS:
        arch = get_model(model).arch
        prompts = grid_module.grid_prompts(model)
        lens = [len(p) for p in prompts]
        assert min(lens) == 16 and max(lens) <= hf_config(get_model(model)).get_text_config().max_position_embeddings
        for e in grid_module.ENGINES:
            if capabilities(e).serves(arch):
                assert max(lens) > grid_module.grid_step(e, model), (model, e, lens)
        assert max(lens) == (2305 if model == "nemotron-3-super-120b-a12b" else 4609), (model, lens)
    assert grid_module.step_options("vllm", "gpt-oss-20b")["llm_kwargs"]["max_num_batched_tokens"] == 4096
    assert grid_module.step_options("sglang", "qwen3-30b-a3b")["server_args"]["chunked_prefill_size"] == 4096
    assert grid_module.step_options("triton", "qwen3-30b-a3b") == {"max_batch_tokens": 4096}
    assert grid_module.step_options("vllm", "nemotron-3-nano-30b-a3b") == {}  # 2048 with LoRA, below the cap


def test_neutrality_lanes_carry_their_gpu_mark_at_tp_1_and_2_and_judge_hf_fp32_too():
    assert_every_cell_at_tp_1_and_2(grid_module.neutrality_grid(), "-neutrality")
    assert grid_module.neutrality_cannot_serve("hf", "qwen3-30b-a3b", 1, "float32") is None
    assert "runs TP 1 only" in grid_module.neutrality_cannot_serve("hf", "qwen3-30b-a3b", 2, "float32")
    assert "no float32 LoRA path" in grid_module.neutrality_cannot_serve("vllm", "qwen3-30b-a3b", 1, "float32")
