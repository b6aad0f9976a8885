"""GPU suite: real serving engines judged on full-width models (harness/check.py, ``lpdiff check``).

Every catalog model at full width, cut to ``LAYERS`` layers (fits one GPU next to the fp32 reference and keeps
engine starts at 1-3 min), weights from the catalog's seeded init recipe ``RECIPE``. vLLM, SGLang, the triton
runtime and HF itself serve, in bf16 and (where the engine has an fp32 LoRA path) fp32, one batch holding base rows
and every adapter of harness.check.ADAPTERS in every layout the engine reads; each lane is judged against HF+PEFT in
fp32 with check.FACTOR x the noise measured in the same run (bf16: HF bf16 vs fp32; fp32: HF's two expert kernels;
and the engine's own reruns). Correct adapters must PASS, the deliberately broken one (every expert's LoRA-B shifted
to the next expert) must FAIL. The prompts (grid_prompts) are RL-like: chat-templated prompt + response and raw ids
of 16 tokens up to past every engine's prefill step, packed short with long in one batch; engines run at a step of
at most GRID_MAX_STEP (4096: what the fp32 runs can score at full width), so the longest prompt is 4609 tokens
(2305 on Nemotron-Super). A NaN/inf logprob anywhere is a FAIL naming lane, prompt and position (verdict.judge).

Engines run where they are installed: in this interpreter, or through ``LPDIFF_VLLM_PYTHONPATH`` /
``LPDIFF_SGLANG_PYTHONPATH`` (an unpacked offline bundle; the engine then runs in a subprocess lane with that
PYTHONPATH). ``LPDIFF_CHECK_CSV_DIR=dir`` appends every lane to ``dir/engines_gpu.csv``
(benchmarks/results/engines_gpu.csv holds the committed runs).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from lpdiff.engines.base import capabilities, layouts_for
from lpdiff.engines.progress import progress_log
from lpdiff.harness.commands import check
from lpdiff.harness.pipeline.session import engine_missing, engine_options, engine_required
from lpdiff.harness.spec.catalog import PEAKED, get_model, known_models, resolve_init_recipe

# depth per model: full width, cut so that every layer kind is present (Qwen3.5: three Gated-DeltaNet layers then
# full attention; Nemotron-H: mamba, MoE and one attention layer of its pattern), the fp32 reference fits one GPU
# beside the engine, and engine starts stay at 1-3 min (H100: SGLang under 1 min, then 1-2 min of kernel compiles in
# its first batches; vLLM 1.2 min on Qwen3-MoE, 3 min on Qwen3.5, whose Triton GDN kernels compile in its profile run)
LAYERS = {
    "qwen3-30b-a3b": 4,
    "gpt-oss-20b": 4,
    "qwen3.5-35b-a3b": 4,
    "nemotron-3-nano-30b-a3b": 8,
    "nemotron-3-super-120b-a12b": 8,
}
MODELS = [m for m in LAYERS if m in known_models()]
ENGINES = ["triton", "vllm", "sglang", "hf"]  # hf in bf16 is an engine too: the reference's own rounding
TPS = [1, 2, 4, 8]
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # id suffix -> dtype the engine runs in
# the full-size models' weights: peaked/v1 (decisive routers, peaked outputs) unless $LPDIFF_INIT_RECIPE says
# otherwise. With the default random init, near-tied routers flip under bf16 rounding and the broken adapter
# cleared gpt-oss-20b's threshold by 1.8x; with peaked/v1 by 118x (benchmarks/results/engines_gpu.md)
RECIPE = resolve_init_recipe(default=PEAKED)
# the fp32 reference the engines are judged against: HF+PEFT, or lpdiff's triton runtime (fp32 parity with HF+PEFT
# to ~1e-5 at these shapes, tests/engines/triton/test_engine_gpu.py); its noise pair is its torch-reference kernels
# vs Triton
REFERENCE = os.environ.get("LPDIFF_CHECK_REFERENCE", "hf")
assert REFERENCE in ("hf", "triton"), f"LPDIFF_CHECK_REFERENCE must be hf or triton, got {REFERENCE!r}"


def grid(tps=TPS, suffix: str = ""):
    """Every model x engine x TP x dtype, marked gpuN by the GPUs the case needs (TP N): ``-m gpu8`` selects every
    model at TP 8. A combination the engine's capabilities rule out is still collected and skips with their reason.
    ``suffix`` ends the ids of a further grid over the same cells (-trainer, -neutrality)."""
    for model in MODELS:
        for engine in ENGINES:
            for tp in tps:
                for tag, dtype in DTYPES.items():
                    yield pytest.param(
                        model,
                        engine,
                        tp,
                        dtype,
                        marks=getattr(pytest.mark, f"gpu{tp}"),
                        id=f"{model}-{engine}-tp{tp}-{tag}{suffix}",
                    )


def cannot_serve(engine: str, model: str, tp: int, dtype: str) -> str | None:
    caps = capabilities(engine)
    arch = get_model(model).arch
    if not caps.serves(arch):
        return f"{caps.label} does not serve {arch} (capabilities: {', '.join(caps.archs or ())})"
    if tp not in caps.tp:
        return f"{caps.label} runs TP {', '.join(map(str, caps.tp))} only (capabilities)"
    if dtype not in caps.dtypes or (dtype == "float32" and not caps.lora_fp32):
        return f"{caps.label} has no {dtype} LoRA path (capabilities)"
    if engine == REFERENCE and dtype == "float32":
        return (
            f"{caps.label} in fp32 is the reference itself (benchmarks/detection.py judges its expert kernels "
            f"against each other)"
        )
    return None


# -- the prompts: RL-like long prompts packed with short ones (issue 42) ----------------------------------------------

# the largest prefill step the grid runs a model with: an engine whose own step is larger runs at this one (its
# step option), so that the set's longest prompt (just past it) crosses every engine's step while the fp32 runs can
# score it. Measured (H200, qwen3-30b-a3b x4, triton fp32, an 18433-token prompt past vLLM's own 16384 step): SDPA's
# fp32 path asked for 40.5 GiB (32 heads x n^2 scores) beside 104.7 GiB of CUDA-graph pools: out of memory. Also
# read, not run: HF's gpt-oss has no SDPA (its sinks), its eager attention holds 64 heads x n^2 fp32 scores (87 GB
# at 18433 tokens); HF's torch Mamba-2 path (no mamba-ssm on the GPU image) materialises C x B per chunk, ~4.2 MB
# per token and mamba layer at Nano's 64 heads x 128 state (Super 2x) for each padded batch of up to 8192 tokens.
# 4096 keeps every one of these under ~20 GB (a 4609-token prompt: 2.7 GB of fp32 scores at 32 heads);
# LPDIFF_GRID_MAX_STEP=16384 runs vLLM and SGLang at their own H200 steps (bf16 rows only: see above)
GRID_MAX_STEP = int(os.environ.get("LPDIFF_GRID_MAX_STEP", "4096"))
GRID_STEP_CAP = {"nemotron-3-super-120b-a12b": 2048}  # twice Nano's mamba heads, and 512 experts


def _step_cap(model: str) -> int:
    return min(GRID_MAX_STEP, GRID_STEP_CAP.get(model, GRID_MAX_STEP))


def grid_step(engine: str, model: str) -> int | None:
    """The prefill step ``engine`` runs ``model`` with in the grid: its own (Capabilities.prefill_step_for),
    capped at GRID_MAX_STEP (GRID_STEP_CAP per model)."""
    step = capabilities(engine).prefill_step_for(get_model(model).arch)
    return None if step is None else min(step, _step_cap(model))


def step_options(engine: str, model: str) -> dict:
    """Engine options that set the grid's step where it is below the engine's own, merged into the engine's
    options from the environment ($LPDIFF_<ENGINE>_OPTIONS: run_check merges options shallowly)."""
    caps = capabilities(engine)
    step, own = grid_step(engine, model), caps.prefill_step_for(get_model(model).arch)
    if step is None or step == own or not caps.prefill_step_option:
        return {}
    out = engine_options(engine)
    where = out
    for key in caps.prefill_step_option[:-1]:
        where[key] = dict(where.get(key) or {})
        where = where[key]
    where[caps.prefill_step_option[-1]] = step
    return out


def grid_prompts(model: str) -> list[list[int]]:
    """The grid's prompts for ``model``: prompts.rl_prompts up to the model's max_position_embeddings or just past its
    capped step, whichever is less, whose longest crosses the largest grid_step of the engines serving it (ids from
    the zoo tokenizer: every catalog vocabulary holds them, and the random weights do not care what they mean)."""
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.spec.prompts import past_step, rl_prompts

    spec = get_model(model)
    steps = [s for e in ENGINES if capabilities(e).serves(spec.arch) and (s := grid_step(e, model))]
    max_len = hf_config(spec).get_text_config().max_position_embeddings
    max_len = min(max_len, past_step(_step_cap(model)))  # what the fp32 runs can score: just past the capped step
    return rl_prompts(max_len, max(steps, default=None))


_CASES: dict[str, check.Case] = {}
_CASE_DIRS: list[Path] = []


def _new_case_dir(tmp_path_factory, name: str) -> Path:
    """A fresh folder for the next case, the previous cases' folders deleted: at full width one case's adapters and
    checkpoint take 4-23 GB (Qwen3.5's trainer case, rank 256 on 256 experts, in two layouts), and the GPU machine's
    disk (64 GiB) filled after three of them (H200, "No space left on device")."""
    import shutil

    _CASES.clear()
    while _CASE_DIRS:
        shutil.rmtree(_CASE_DIRS.pop(), ignore_errors=True)
    _CASE_DIRS.append(tmp_path_factory.mktemp(name))
    return _CASE_DIRS[-1]


def case_for(model: str, tmp_path_factory) -> check.Case:
    """One case per model per worker process (adapters written once, ~10 s)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if model not in _CASES:
        root = _new_case_dir(tmp_path_factory, model)  # one case's files at a time
        case = check.build_case(model, LAYERS[model], root, init_recipe=RECIPE, log=progress_log(f"[{model}] "))
        case.prompts = grid_prompts(model)
        _CASES[model] = case
    return _CASES[model]


@pytest.fixture(scope="module", params=["qwen3-30b-a3b", "gpt-oss-20b"])
def case(request, tmp_path_factory):
    return case_for(request.param, tmp_path_factory)


def _installed(engine: str) -> None:
    """A missing engine skips its cases, unless the job named it ($LPDIFF_REQUIRE_ENGINES): then they fail."""
    if why := engine_missing(engine):
        (pytest.fail if engine_required(engine) else pytest.skip)(why)


# vLLM serves each adapter layout through a different LoRA wrapper (PEFT 3D on a per-expert model needs the
# mixed-format flag); one engine per layout keeps a crash in one path from hiding the other (H200: the
# PEFT 3D path on Qwen3-MoE faults, docs/engines.md)
ONE_SESSION_PER_LAYOUT = {"vllm"}


def _report(engine: str, res, record_verdict=None) -> None:
    """Print the result, append it to LPDIFF_CHECK_CSV_DIR/engines_gpu.csv, hand its verdicts to the plugin."""
    print("\n" + check.format_result(res))
    if os.environ.get("LPDIFF_CHECK_CSV_DIR"):
        check.write_csv(res, Path(os.environ["LPDIFF_CHECK_CSV_DIR"]) / "engines_gpu.csv")
    for v in res.verdicts if record_verdict else ():
        record_verdict(v)


def _judge(engine: str, case, tp: int, dtype: str, record_verdict, options: dict | None = None) -> None:
    # hf reads per-expert files by converting them to PEFT 3D, exactly the reference's files (tests/
    # test_hf_per_expert.py): on the GPU those lanes would double HF's time and show nothing new
    layouts = ("peft3d",) if engine == "hf" else layouts_for(engine, case.spec.arch)
    sessions = [(lay,) for lay in layouts] if engine in ONE_SESSION_PER_LAYOUT else [layouts]
    log = progress_log(f"[{case.spec.name}-{engine}-tp{tp}-{dtype}] ")
    results = [
        check.run_check(
            check.CheckRequest(case, engine, tp=tp, reference=REFERENCE, layouts=lays, dtype=dtype, options=options),
            log=log,
        )
        for lays in sessions
    ]
    # engine defects declared for this TP size (the engine's capabilities): an error must come out NOT as expected
    # (the day it comes out as expected the test fails, so the fix gets recorded); a warning may, but only as the
    # engine's own error: lanes that come out wrong without one are the silent case
    defects = [d for d in capabilities(engine).defects(case.spec.arch, tp=tp) if d.tp and d.severity != "info"]
    failure = outcome(results, defects)
    for res in results:
        for v in res.verdicts if defects and failure is None else ():
            v.expected = "FAIL" if not v.passed else v.expected  # the defect's lanes, marked so in the reports
        _report(engine, res, record_verdict)
    assert failure is None, failure


def outcome(results, defects) -> str | None:
    """Why one case's check results (one per engine session) fail the grid, given the TP defects declared for it;
    None if they do not."""
    table = "\n".join(check.format_result(r) for r in results)
    as_expected = all(res.as_expected for res in results)
    if must := [d for d in defects if d.severity == "error"]:
        return (
            f"{must[0].id} ({must[0].versions}): no longer reproduced, record the fix\n{table}" if as_expected else None
        )
    if defects:
        if all(r.as_expected or r.error is not None for r in results):
            return None
        return f"{defects[0].id} is declared as an engine failure, but lanes came out wrong without one:\n{table}"
    return None if as_expected else table


@pytest.mark.parametrize("model,engine,tp,dtype", list(grid()))
def test_engine_vs_reference(model, engine, tp, dtype, tmp_path_factory, record_verdict):
    """The engine in ``dtype`` at TP ``tp`` against the fp32 reference at TP 1, every adapter lane of
    check.ADAPTERS in every layout the engine reads: correct adapters PASS, the broken one FAILs. Tensor parallelism
    is judged the same way: a delta counted once per rank or a mis-sliced LoRA shard moves every adapter lane far
    above the noise (in fp32, HF's two expert kernels differ by ~1e-11 in k2)."""
    if why := cannot_serve(engine, model, tp, dtype):
        pytest.skip(why)
    _installed(engine)
    _judge(engine, case_for(model, tmp_path_factory), tp, dtype, record_verdict, step_options(engine, model))


# -- adapters as trainers write them (issue 42) ---------------------------------------------------------------------

TRAINER_TPS = [1, 2]


def trainer_grid():
    """Every model x engine x dtype at TP 1 and 2, ids ending -trainer: check.trainer_plans_for's lanes (rsLoRA with
    rank/alpha patterns, lm_head + embed_tokens, rank 128 and 256) beside "all", "broken" and base rows in one
    batch; doctor's refusals for the engine are reported as not served, with its reason."""
    return grid(TRAINER_TPS, "-trainer")


def trainer_case_for(model: str, engine: str, tmp_path_factory) -> check.Case:
    """The trainer lanes' case, its adapters written in the reference's layout (PEFT 3D) and ``engine``'s only."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    layouts = sorted({"peft3d", *layouts_for(engine, get_model(model).arch)})
    key = f"{model}:trainer:{','.join(layouts)}"
    if key not in _CASES:
        root = _new_case_dir(tmp_path_factory, f"{model}-trainer")
        _CASES[key] = check.build_case(
            model,
            LAYERS[model],
            root,
            layouts=layouts,
            plans=check.trainer_plans_for(get_model(model).arch),
            init_recipe=RECIPE,
            log=progress_log(f"[{model}-trainer] "),
        )
    return _CASES[key]


@pytest.mark.parametrize("model,engine,tp,dtype", list(trainer_grid()))
def test_trainer_adapters_vs_reference(model, engine, tp, dtype, tmp_path_factory, record_verdict):
    """The trainer lanes the engine accepts (doctor refuses the others with the engine's reason: vLLM 0.25.1
    rank_pattern/alpha_pattern, expert rank > 128 and lm_head LoRA, SGLang rsLoRA and patterns) judged like the main
    grid's: every served correct lane PASSes, "broken" FAILs."""
    if why := cannot_serve(engine, model, tp, dtype):
        pytest.skip(why)
    _installed(engine)
    case = trainer_case_for(model, engine, tmp_path_factory)
    if engine == "triton" and case.spec.arch.removesuffix("_text") == "qwen3_5_moe":
        # the runtime runs embedding LoRA on qwen3_moe, gpt_oss and nemotron_h only (Qwen3.5's model builds its own
        # embedding lookup) and refuses the session at start: those lanes are left out here, said so in the output
        dropped = sorted(n for n, p in case.plans.items() if "embed_tokens" in p.groups)
        print(f"\ntriton on {case.spec.arch}: lanes {dropped} not served (no embedding LoRA on hybrids)")
        case = dataclasses.replace(
            case,
            plans={n: p for n, p in case.plans.items() if n not in dropped},
            files={k: v for k, v in case.files.items() if k[0] not in dropped},
        )
    _judge(engine, case, tp, dtype, record_verdict)


# -- decode verdicts (issue 42) --------------------------------------------------------------------------------------

DECODE_TOKENS = 16
# the prefill check's threshold per (model, engine, dtype): greedy and seeded decode judge against the same one, so
# the second case skips a whole engine start (1.5-3.5 min for vLLM and SGLang on these models)
_DECODE_THRESHOLDS: dict[tuple[str, str, str], float] = {}


def decode_grid():
    """Every model x engine x dtype at TP 1, greedy and seeded, ids ending -decode-<sampling>."""
    for model in MODELS:
        for engine in ENGINES:
            for tag, dtype in DTYPES.items():
                for sampling in ("greedy", "seeded"):
                    yield pytest.param(
                        model,
                        engine,
                        dtype,
                        sampling,
                        marks=pytest.mark.gpu1,
                        id=f"{model}-{engine}-tp1-{tag}-decode-{sampling}",
                    )


@pytest.mark.parametrize("model,engine,dtype,sampling", list(decode_grid()))
def test_decode_vs_reference(model, engine, dtype, sampling, tmp_path_factory):
    """The engine generates DECODE_TOKENS per prompt under every lane the check case has that doctor does not refuse
    for a decode verdict (one layout, base rows and adapters in one batch) with its own logprobs; the fp32 reference
    scores prompt + generated by prefill. A lane PASSes when every logprob is finite and k2 and max |d| are within the
    threshold the same run's prefill check measured; the RL mismatch metrics are printed beside (commands/decode.py).
    The case's ``broken`` adapter (every expert's LoRA-B shifted one expert) is served to the engine while the
    reference scores its sequences with the correct ``all`` file: it must FAIL, the correct lanes PASS (asserted as
    expected, as the prefill check is), so a decode verdict that cannot see an expert-ordering bug fails here. The
    triton runtime decodes greedily by re-prefill (its seeded case skips: no sampling without the whole
    distribution)."""
    from lpdiff.harness.commands.decode import check_case_decode, format_decode, write_decode_csv

    if why := cannot_serve(engine, model, 1, dtype):
        pytest.skip(why)
    if engine == "triton" and sampling == "seeded":
        pytest.skip("the triton runtime is prefill-only: it decodes greedily by re-prefill, no seeded sampling")
    _installed(engine)
    case = case_for(model, tmp_path_factory)
    step = step_options(engine, model)  # the grid's prompts cross this step (grid_prompts)
    if (model, engine, dtype) not in _DECODE_THRESHOLDS:
        res = check.run_check(
            check.CheckRequest(case, engine, k=2, reference=REFERENCE, dtype=dtype, options=step),
            log=progress_log(f"[{model}-{engine}-decode] "),
        )
        assert res.error is None, check.format_result(res)
        _DECODE_THRESHOLDS[(model, engine, dtype)] = res.threshold
    dec = check_case_decode(
        case,
        engine,
        _DECODE_THRESHOLDS[(model, engine, dtype)],
        1,
        dtype,
        REFERENCE,
        DECODE_TOKENS,
        sampling,
        seed=0,
        options=step,
        log=progress_log(f"[{model}-{engine}-decode] "),
    )
    print("\n" + format_decode(dec))
    if os.environ.get("LPDIFF_CHECK_CSV_DIR"):
        write_decode_csv(dec, Path(os.environ["LPDIFF_CHECK_CSV_DIR"]) / "engines_gpu_decode.csv")
    assert any(ln.expected == "FAIL" for ln in dec.lanes), "no broken lane served: the verdict's power is unshown"
    assert dec.as_expected, format_decode(dec)


# -- LoRA neutrality (issue 42) --------------------------------------------------------------------------------------

NEUTRAL_TPS = [1, 2]


def neutrality_grid():
    """Every model x engine x dtype at TP 1 and 2, ids ending -neutrality (hf in fp32 too: the reference's own base
    rows must not move when PEFT holds adapters)."""
    return grid(NEUTRAL_TPS, "-neutrality")


def neutrality_cannot_serve(engine: str, model: str, tp: int, dtype: str) -> str | None:
    """cannot_serve, except that hf in fp32 is judged too (against itself, not as the reference)."""
    why = cannot_serve(engine, model, tp, dtype)
    return None if why and engine == REFERENCE and dtype == "float32" and "reference itself" in why else why


@pytest.mark.parametrize("model,engine,tp,dtype", list(neutrality_grid()))
def test_lora_neutrality(model, engine, tp, dtype, tmp_path_factory, tmp_path):
    """The metamorphic relation ``neutral`` on the grid's case: base rows of an engine holding every adapter lane
    the check serves it (one layout, doctor's refusals left out), alone and each beside a row of every adapter,
    against the same engine started without adapters, over the grid's RL-like prompts at the grid's step. Exact:
    bit for bit where the engine's reruns are (SGLang, triton, HF), within its LoRA rerun noise otherwise (vLLM
    0.25.1; x metamorphic.FACTORS), positions before the first router near-tie (random-init routers)."""
    from lpdiff.engines.base import layouts_for
    from lpdiff.harness.commands import metamorphic as mm
    from lpdiff.harness.pipeline.metrics import near_tie_eps

    if why := neutrality_cannot_serve(engine, model, tp, dtype):
        pytest.skip(why)
    _installed(engine)
    case = case_for(model, tmp_path_factory)
    lanes = check.served_files(case, engine, layouts_for(engine, case.spec.arch)[:1])
    refused = check.refused_lanes(case, engine, lanes)
    served = {lane: a.path for lane, a in lanes.items() if lane not in refused}
    orig = next((lane for lane in served if lane.split(".")[0] == "all"), None)
    assert orig is not None, f"doctor refuses the 'all' adapter for {engine}: {refused}"
    options = {**engine_options(engine), **step_options(engine, model)}
    if "python" in options:  # a subprocess lane: an engine that hangs becomes an error carrying its log tail
        options.setdefault("lane_call_timeout_s", 600)
    rep = mm.run_metamorphic(
        engine,
        case.spec,
        served[orig],
        case.prompts,
        adapter_name=orig,
        dtype=dtype,
        tp=tp,
        options=options,
        relations=["neutral"],
        near_tie_eps=near_tie_eps(dtype),
        tmp=tmp_path,
        neighbours={lane: p for lane, p in served.items() if lane != orig},
        log=progress_log(f"[{model}-{engine}-tp{tp}-neutrality] "),
    )
    print("\n" + mm.format_report(rep))
    if os.environ.get("LPDIFF_METAMORPHIC_CSV"):
        mm.write_csv(rep, os.environ["LPDIFF_METAMORPHIC_CSV"])
    judged = [r for r in rep.results if r.verdict != "n/a"]
    assert judged and not rep.failed, mm.format_report(rep)


# -- known engine defects, reproduced on purpose: lpdiff must report them ----------------------------------------

EXPERT_ADAPTERS = {"all", "experts", "all_r8", "broken"}  # the ADAPTERS that carry expert LoRA


@pytest.mark.gpu1
def test_vllm_gpt_oss_per_expert_layout_fails(case, record_verdict):
    """vLLM 0.25.1 reads per-expert gpt-oss expert LoRA (names w1/w2/w3) only with enable_mixed_moe_lora_format,
    whose 2D kernel adds gate and up as concatenated halves onto gpt-oss's interleaved gate/up rows
    (engines/vllm.py). The engine refuses that layout unless forced; forced, every lane with expert LoRA must
    FAIL and the attention-only and base lanes must PASS."""
    if case.spec.arch != "gpt_oss":
        pytest.skip("gpt-oss only")
    _installed("vllm")
    res = check.run_check(
        check.CheckRequest(
            case, "vllm", layouts=("per_expert",), options={"mixed_moe_lora_format": True}, serve_refused=True
        )
    )
    _report("vllm", res, record_verdict)
    assert res.error is None, res.error
    got = {v.adapter.split(".")[0]: v.passed for v in res.verdicts}
    assert not any(got[a] for a in EXPERT_ADAPTERS), got
    assert got["base"] and got["attention"], got


@pytest.mark.gpu1
def test_vllm_qwen3_peft3d_layout_is_judged_or_reported(case, record_verdict):
    """vLLM 0.25.1 serves PEFT 3D expert adapters on Qwen3-MoE through enable_mixed_moe_lora_format (converted to
    its 2D per-expert buffers at load). With the check's 5 adapters and base rows in one batch its engine faulted
    with an illegal memory access in 3 of 3 runs on an H200 (default init), and served them correctly in 1 of 1 on
    an H100 (peaked/v1): intermittent (doctor: vllm-peft3d-mixed-format-faults, a warning). Either way lpdiff must
    say which: every lane as expected, or a FAIL carrying the engine's error; a live engine whose lanes come out
    wrong without an error is the silent case this test exists to catch."""
    if case.spec.arch != "qwen3_moe":
        pytest.skip("the mixed-format path serves PEFT 3D only where the model's native layout is per-expert")
    _installed("vllm")
    res = check.run_check(check.CheckRequest(case, "vllm", layouts=("peft3d",), serve_refused=True))
    _report("vllm", res, record_verdict)
    assert res.as_expected or res.error is not None, check.format_result(res)


@pytest.mark.gpu1
def test_vllm_nemotron_super_latent_lora_is_dropped(tmp_path_factory, record_verdict):
    """vLLM 0.25.1 wraps Nemotron-Super's latent projections in LoRA layers its MoE runner never calls (doctor:
    vllm-nemotron-latent-dropped; measured: the latent-only lane equalled the base model at TP 1 and 2). Served
    anyway, that lane must FAIL as the base model (delta fidelity near 1) while the other lanes PASS; the day it
    passes, the fix gets recorded."""
    case = case_for("nemotron-3-super-120b-a12b", tmp_path_factory)
    _installed("vllm")
    res = check.run_check(check.CheckRequest(case, "vllm", serve_refused=True))
    got = {v.adapter.split(".")[0]: v for v in res.verdicts}
    if "latent" in got:
        got["latent"].expected = "FAIL"  # the declared defect, marked so in the reports
    _report("vllm", res, record_verdict)
    assert res.error is None, res.error
    assert "latent" in got, f"no latent lane was served: {sorted(got)}"
    assert not got["latent"].passed and got["latent"].delta_fidelity > 0.9, "vLLM served the latent LoRA: record it"
    assert all(v.passed == (v.expected == "PASS") for a, v in got.items() if a != "latent"), check.format_result(res)


@pytest.mark.gpu1
def test_sglang_peft3d_expert_adapter_is_a_fail_with_the_engine_log(case):
    """SGLang 0.5.15 skips PEFT 3D expert weights and its scheduler dies at the first LoRA request (docs/engines.md;
    `lpdiff doctor` says so before a run: peft3d-kills-sglang). Served anyway, the subprocess lane turns the dead
    engine into a FAIL result carrying the engine's last log lines, and the test session goes on."""
    if case.spec.arch != "qwen3_moe":
        pytest.skip("one model is enough to show it")
    _installed("sglang")
    res = check.run_check(
        check.CheckRequest(
            case, "sglang", k=2, layouts=("peft3d",), options={"lane_call_timeout_s": 120}, serve_refused=True
        )
    )
    _report("sglang", res)
    assert res.error is not None and not res.as_expected, "SGLang served a PEFT 3D expert adapter: record the fix"
    assert "Lane" in res.error
