"""``lpdiff doctor`` on the tiny zoo's architectures: each known failure is caught with a one-line explanation and
its fix, a clean adapter passes, and the exit code says whether something will break.

Adapters are written by lpdiff's generator/converter or by PEFT itself; where PEFT refuses to write one (routers it
cannot wrap, Nemotron's out_proj), the adapter directory is written by hand as another tool would. The per-expert
rule is checked against real PEFT: the adapter it flags really changes nothing in HF+PEFT.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lpdiff.harness.cli import main as cli_main  # noqa: E402
from lpdiff.harness.commands.doctor import ENGINES, doctor, format_report  # noqa: E402
from lpdiff.harness.types import ModelSpec  # noqa: E402


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> (ModelSpec, model): the zoo checkpoint when built, else the zoo's config with a seeded init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.harness.build.zoo import TINY_CONFIGS
    from lpdiff.harness.spec.catalog import ZOO, get_model, load_hf_model

    root, out = tmp_path_factory.mktemp("doctor"), {}
    for name in ("tiny-qwen3-moe", "tiny-gpt-oss", "tiny-qwen3.5-moe", "tiny-nemotron-h"):
        spec = get_model(name)
        if not (Path(spec.path) / "config.json").is_file():
            kw = dict(TINY_CONFIGS[name])
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).save_pretrained(
                str(root / name)
            )
            spec = ModelSpec(name=name, arch=ZOO[name], path=str(root / name))
        out[name] = (spec, load_hf_model(spec, torch.float32, "cpu"))
    return out


def gen(zoo, tmp_path, name, groups, layout="peft3d", rank=4):
    from lpdiff.harness.spec.adapters import generate_adapter

    return generate_adapter(
        zoo[name][1], tmp_path / f"{name}-{layout}-{rank}", groups=groups, rank=rank, alpha=2 * rank, layout=layout
    ).path


def hand_written(path: Path, config: dict, shapes: dict[str, tuple]) -> str:
    """An adapter directory as a tool other than PEFT would write it (PEFT refuses to create these)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 16, **config}))
    rng = np.random.default_rng(0)  # not zeros: an all-zero B is its own finding (adapter-no-op)
    save_file(
        {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()},
        str(path / "adapter_model.safetensors"),
    )
    return str(path)


def lora_keys(module: str, rank: int, n_in: int, n_out: int) -> dict[str, tuple]:
    p = f"base_model.model.{module}"
    return {f"{p}.lora_A.weight": (rank, n_in), f"{p}.lora_B.weight": (n_out, rank)}


def check(report, engine, severity, code):
    hits = [f for f in report.findings if f.engine == engine and f.code == code]
    assert hits, f"expected {engine}/{code}; got:\n{format_report(report)}"
    assert hits[0].severity == severity
    assert "\n" not in hits[0].message and hits[0].fix, "one line, with a fix"
    return hits[0]


def test_clean_attention_adapter_passes(zoo, tmp_path):
    a = gen(zoo, tmp_path, "tiny-qwen3-moe", ("self_attn.q_proj", "self_attn.v_proj"))
    r = doctor(zoo["tiny-qwen3-moe"][0], a)
    assert r.exit_code == 0 and r.codes(severity="error") == set() and r.codes(severity="warning") == set()
    assert r.engines == list(ENGINES)


def test_router_target(zoo, tmp_path):
    # qwen3_moe's router is Linear-like: PEFT wraps it (hf fine), SGLang refuses router LoRA
    from peft import LoraConfig, get_peft_model

    from lpdiff.harness.spec.catalog import load_hf_model

    spec = zoo["tiny-qwen3-moe"][0]
    model = load_hf_model(spec, torch.float32, "cpu")
    get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate"], init_lora_weights=False)
    ).save_pretrained(str(tmp_path / "r"))
    r = doctor(spec, tmp_path / "r")
    assert "fails to start" in check(r, "sglang", "error", "router-target").message
    assert "hf" not in {f.engine for f in r.findings if f.severity == "error"} and r.exit_code == 1


def test_router_target_peft_cannot_wrap(zoo, tmp_path):
    # gpt-oss's router is a TopKRouter, not a Linear: PEFT itself refuses, SGLang refuses
    a = hand_written(
        tmp_path / "gr",
        {"r": 4, "target_modules": ["q_proj", "v_proj", "router"]},
        lora_keys("model.layers.0.mlp.router", 4, 128, 8),
    )
    r = doctor(zoo["tiny-gpt-oss"][0], a)
    assert "router" in check(r, "hf", "error", "peft-refused").message
    check(r, "sglang", "error", "router-target")


def test_nemotron_router_silently_dropped_by_vllm(zoo, tmp_path):
    a = hand_written(
        tmp_path / "nr", {"r": 4, "target_modules": ["gate"]}, lora_keys("model.layers.1.mixer.gate", 4, 128, 8)
    )
    r = doctor(zoo["tiny-nemotron-h"][0], a)
    assert "silently dropped" in check(r, "vllm", "error", "router-target").message


def test_peft3d_expert_adapter(zoo, tmp_path):
    a = gen(zoo, tmp_path, "tiny-qwen3-moe", ("attention", "experts"))
    r = doctor(zoo["tiny-qwen3-moe"][0], a)
    assert "is_3d_lora_weight=True" in check(r, "vllm", "warning", "peft3d-needs-mixed-format").message
    assert "--to per_expert" in check(r, "sglang", "error", "peft3d-kills-sglang").fix
    # vLLM's mixed-format path faults on Qwen3-MoE (H200); gpt-oss reads PEFT 3D natively
    assert "--to per_expert" in check(r, "vllm", "error", "vllm-peft3d-mixed-format-faults").fix
    g = gen(zoo, tmp_path / "g", "tiny-gpt-oss", ("experts",))
    assert "vllm-peft3d-mixed-format-faults" not in doctor(zoo["tiny-gpt-oss"][0], g, engines=["vllm"]).codes()
    assert "hf" not in r.codes(severity="error")


def test_per_expert_gpt_oss_adapter_is_refused_for_vllm(zoo, tmp_path):
    # vLLM 0.25.1 adds gpt-oss's per-expert gate/up LoRA as concatenated halves onto interleaved rows (its engine
    # refuses the layout): the metamorphic suite asks doctor which forms to send, so doctor must say so too
    a = gen(zoo, tmp_path, "tiny-gpt-oss", ("experts",), layout="per_expert")
    assert (
        "--to peft3d"
        in check(
            doctor(zoo["tiny-gpt-oss"][0], a, engines=["vllm"]), "vllm", "error", "vllm-per-expert-interleaved"
        ).fix
    )
    b = gen(zoo, tmp_path / "q", "tiny-qwen3-moe", ("experts",), layout="per_expert")
    assert "vllm-per-expert-interleaved" not in doctor(zoo["tiny-qwen3-moe"][0], b, engines=["vllm"]).codes()


def test_per_expert_qwen35_adapter_is_refused_for_vllm(zoo, tmp_path):
    # measured on vLLM 0.25.1 (H100, TP 2): per-expert expert names on Qwen3.5 fail its LoRA loader's module check
    # at the first request and the engine dies; its PEFT 3D files are read natively
    a = gen(zoo, tmp_path, "tiny-qwen3.5-moe", ("attention", "experts"), layout="per_expert")
    f = check(doctor(zoo["tiny-qwen3.5-moe"][0], a, engines=["vllm"]), "vllm", "error", "vllm-qwen3.5-per-expert")
    assert "--to peft3d" in f.fix and "lora_model.py:237" in f.message
    b = gen(zoo, tmp_path / "p", "tiny-qwen3.5-moe", ("attention", "experts"))
    assert "vllm-qwen3.5-per-expert" not in doctor(zoo["tiny-qwen3.5-moe"][0], b, engines=["vllm"]).codes()


def test_text_named_qwen35_adapter_is_refused_for_vllm_and_its_fix_runs(zoo, tmp_path, capsys):
    # measured on vLLM 0.25.1 (H200, TP 1 and 2): adapters named for the text model (model.layers.*) on Qwen3.5's
    # multimodal checkpoint are dropped without a warning, every lane equals the base model; SGLang reads them
    import shlex

    from safetensors import safe_open

    model = zoo["tiny-qwen3.5-moe"][0].path  # a directory: the fix's --model resolves it as printed
    a = gen(zoo, tmp_path, "tiny-qwen3.5-moe", ("attention", "linear_attention", "experts"))
    r = doctor(model, a, engines=["vllm", "sglang", "hf"])
    f = check(r, "vllm", "error", "vllm-qwen3.5-text-names")
    assert "model.layers." in f.message and "qwen3_vl.py:1676" in f.message
    assert f.fix.endswith(f"{a} OUT --to peft3d --disk-root model.language_model"), f.fix
    assert "vllm-qwen3.5-text-names" not in r.codes("sglang") | r.codes("hf")
    out = tmp_path / "rooted"
    argv = shlex.split(f.fix[f.fix.index("lpdiff adapters convert") :].replace(" OUT ", f" {out} "))[1:]
    assert cli_main(argv) == 0, capsys.readouterr().err
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as fh:
        keys = list(fh.keys())
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    fixed = doctor(model, out, engines=["vllm"])
    assert "vllm-qwen3.5-text-names" not in fixed.codes() and fixed.codes("vllm", "error") == set()
    # a per-expert file gets the layout vLLM reads on this model in the same command
    pe = gen(zoo, tmp_path, "tiny-qwen3.5-moe", ("experts",), layout="per_expert")
    assert check(doctor(model, pe, engines=["vllm"]), "vllm", "error", "vllm-qwen3.5-text-names").fix.endswith(
        "--to peft3d --disk-root model.language_model"
    )
    other = gen(zoo, tmp_path, "tiny-qwen3-moe", ("attention", "experts"), layout="per_expert")
    assert "vllm-qwen3.5-text-names" not in doctor(zoo["tiny-qwen3-moe"][0], other, engines=["vllm"]).codes()


@pytest.mark.parametrize(
    "name, peft",
    [
        ("tiny-qwen3.5-moe", "ignores"),  # PEFT alone silently ignores per-expert adapters here
        ("tiny-nemotron-h", "ignores"),  # and here
        ("tiny-gpt-oss", "refuses"),  # an experts-only one matches no module at all here
        ("tiny-qwen3-moe", "converts"),  # but converts them on load here
    ],
)
def test_per_expert_adapter_rule_matches_real_peft(zoo, tmp_path, name, peft):
    """What PEFT alone does with a per-expert file, told as info (lpdiff's hf engine converts the file first, so
    nothing fails for hf), is what real PEFT does. PEFT's own qwen3_moe per-expert conversion is covered here only:
    lpdiff's engines convert before PEFT sees the file."""
    from peft import PeftModel

    from lpdiff.harness.spec.catalog import load_hf_model

    spec = zoo[name][0]
    a = gen(zoo, tmp_path, name, ("experts",), layout="per_expert")
    ignored = peft != "converts"
    cfg_path = Path(a) / "adapter_config.json"
    # init_lora_weights=false: PEFT alone would leave the shared-expert / MLP modules its per-expert names also wrap
    # random, the hf engine's converted file wraps none (test_per_expert_file_with_init_false_is_the_peft3d_adapter)
    for init in (False, True):  # True last: as lpdiff and transformers-4-era PEFT save it (B = 0 where unloaded)
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "init_lora_weights": init}))
        r = doctor(spec, a, engines=["hf"])
        assert r.exit_code == 0 and r.codes("hf", "error") == r.codes("hf", "warning") == set(), format_report(r)
    if ignored:
        f = check(r, "hf", "info", "per-expert-ignored-by-peft")
        assert "--to peft3d" in f.fix and "lpdiff's hf engine converts it" in f.message
    else:
        check(r, "hf", "info", "per-expert-converted-by-peft")
    # what PEFT really does with it: refuses it, or no change at all where the doctor says "ignored"
    ids = torch.tensor([[3, 17, 5, 99, 250, 7, 64, 1000, 12, 40]])
    if peft == "refuses":
        with pytest.raises(ValueError, match="not found in the base model"):
            PeftModel.from_pretrained(load_hf_model(spec, torch.float32, "cpu"), a)
        return
    with torch.no_grad():
        base = load_hf_model(spec, torch.float32, "cpu")(ids).logits
        peft = PeftModel.from_pretrained(load_hf_model(spec, torch.float32, "cpu"), a).eval()(ids).logits
    assert torch.equal(base, peft) == ignored


def test_per_expert_file_with_init_false_is_the_peft3d_adapter(zoo, tmp_path):
    """Why doctor does not flag peft-random-init-modules for hf on a per-expert file: the hf engine's PEFT 3D
    conversion names only the modules with tensors, so Qwen3.5's shared expert gets no random LoRA and the file
    gives its PEFT 3D original's logprobs (a random shared-expert LoRA would move them by far more than 1e-5)."""
    from lpdiff.engines import EngineConfig, open_engine
    from lpdiff.harness.spec.adapters import convert_adapter
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.types import AdapterSpec

    name = "tiny-qwen3.5-moe"
    spec = zoo[name][0]
    p3d = gen(zoo, tmp_path, name, ("attention", "experts"))
    pe = convert_adapter(p3d, tmp_path / "pe", "per_expert", hf_config(spec)).path
    cfg_path = Path(pe) / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "init_lora_weights": False}))
    assert doctor(spec, pe, engines=["hf"]).codes("hf", "error") == set()
    adapters = {"p3d": AdapterSpec("p3d", p3d), "pe": AdapterSpec("pe", pe)}
    prompts = [[3, 17, 5, 99, 250, 7, 64, 1000, 12, 40], [9, 8, 7, 6, 5, 4, 3, 2]]
    with open_engine(
        "hf", EngineConfig(spec, adapters, dtype="float32", device="cpu", options={"router_margins": False})
    ) as eng:
        got = {n: np.concatenate([r.logprobs for r in eng.prompt_logprobs(prompts, n)]) for n in (*adapters, None)}
    assert np.abs(got["pe"] - got["p3d"]).max() <= 1e-5
    assert np.abs(got["p3d"] - got[None]).max() > 1e-3  # the adapter moves the logprobs: the comparison can fail


def test_peft_wraps_modules_without_tensors_in_a_file_it_loads_as_is(zoo, tmp_path):
    """A PEFT 3D file whose target_modules also name the shared expert's gate_proj (no tensors for it): PEFT wraps
    it, at B = 0 by default and random with init_lora_weights=false, and the hf engine loads the file as it is."""
    spec = zoo["tiny-qwen3.5-moe"][0]
    a = gen(zoo, tmp_path, "tiny-qwen3.5-moe", ("attention", "experts"))
    cfg_path = Path(a) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(
        json.dumps({**cfg, "target_modules": [*cfg["target_modules"], "gate_proj"], "init_lora_weights": False})
    )
    assert (
        "shared_expert.gate_proj"
        in check(doctor(spec, a, engines=["hf"]), "hf", "error", "peft-random-init-modules").message
    )
    cfg_path.write_text(
        json.dumps({**cfg, "target_modules": [*cfg["target_modules"], "gate_proj"], "init_lora_weights": True})
    )
    r = doctor(spec, a, engines=["hf"])
    check(r, "hf", "warning", "peft-empty-modules")
    assert "peft-random-init-modules" not in r.codes()


def test_nemotron_out_proj_refused_by_peft(zoo, tmp_path):
    a = hand_written(
        tmp_path / "np",
        {"r": 4, "target_modules": ["in_proj", "out_proj"]},
        lora_keys("model.layers.0.mixer.out_proj", 4, 128, 128),
    )
    r = doctor(zoo["tiny-nemotron-h"][0], a)
    assert "in_proj" in check(r, "hf", "error", "peft-mamba-refused").fix


def test_rank_above_engine_max(zoo, tmp_path):
    a = hand_written(
        tmp_path / "big",
        {"r": 1024, "target_modules": ["q_proj", "v_proj"]},
        lora_keys("model.layers.0.self_attn.q_proj", 1024, 128, 128),
    )
    check(doctor(zoo["tiny-qwen3-moe"][0], a, engines=["vllm"]), "vllm", "error", "rank-above-max")
    small = gen(zoo, tmp_path, "tiny-qwen3-moe", ("attention",), rank=16)
    r = doctor(zoo["tiny-qwen3-moe"][0], small, limits={"sglang": 8})
    assert "max_lora_rank >= 16" in check(r, "sglang", "error", "rank-above-max").fix


def test_vllm_moe_lora_rank_above_128(zoo, tmp_path):
    # vLLM's fused MoE-LoRA kernel stops at rank 128 while its attention LoRA goes to 512
    experts = gen(zoo, tmp_path / "e", "tiny-qwen3-moe", ("experts",), rank=160)
    check(doctor(zoo["tiny-qwen3-moe"][0], experts, engines=["vllm"]), "vllm", "error", "moe-rank-above-128")
    attention = gen(zoo, tmp_path / "a", "tiny-qwen3-moe", ("attention",), rank=160)
    assert not [
        f
        for f in doctor(zoo["tiny-qwen3-moe"][0], attention, engines=["vllm"]).findings
        if f.code == "moe-rank-above-128"
    ]


@pytest.mark.parametrize(
    "targets, severity, code",
    [
        (["q_proj", "v_proj", "qkv_projj"], "warning", "target-matches-nothing"),  # one typo: ignored silently
        (["nope_proj"], "error", "targets-match-nothing"),  # nothing at all: PEFT refuses, engines load nothing
    ],
)
def test_targets_that_match_nothing(zoo, tmp_path, targets, severity, code):
    a = hand_written(
        tmp_path / "t", {"r": 4, "target_modules": targets}, lora_keys("model.layers.0.self_attn.q_proj", 4, 128, 128)
    )
    check(doctor(zoo["tiny-qwen3-moe"][0], a), "all", severity, code)


def test_cli_prints_one_line_per_finding_and_exits_nonzero(zoo, tmp_path, capsys):
    a = gen(zoo, tmp_path, "tiny-qwen3-moe", ("attention", "experts"))
    assert cli_main(["doctor", zoo["tiny-qwen3-moe"][0].path, a, "--engine", "sglang"]) == 1
    out = capsys.readouterr().out
    assert "sglang  ERROR    " in out and "lpdiff adapters convert --model " in out and "--to per_expert" in out
    assert cli_main(["doctor", zoo["tiny-qwen3-moe"][0].path, a, "--engine", "hf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exit_code"] == 0


def test_per_expert_adapter_on_hf_is_info_and_does_not_block_a_run(zoo, tmp_path, capsys):
    """A per-expert gpt-oss adapter (attention + experts: PEFT alone drops its experts silently): doctor exits 0
    for hf and tells the raw-PEFT fact as info with the convert command; a run's preflight for hf lets it through,
    and `lpdiff regen` then `lpdiff run --engine hf` judge it (exit 0), while vLLM (which misreads gpt-oss
    per-expert gate/up) is still stopped."""
    from lpdiff.harness.commands.preflight import preflight
    from lpdiff.harness.spec.resolve import SpecError, resolve

    model = zoo["tiny-gpt-oss"][0].path
    a = gen(zoo, tmp_path, "tiny-gpt-oss", ("attention", "experts"), layout="per_expert")
    assert cli_main(["doctor", model, a, "--engine", "hf"]) == 0
    out = capsys.readouterr().out
    assert "hf      INFO     per-expert adapter on gpt_oss: lpdiff's hf engine converts it" in out
    assert f"lpdiff adapters convert --model {model} {a} OUT --to peft3d" in out and "hf      OK" in out
    assert cli_main(["doctor", model, a, "--engine", "hf", "--json"]) == 0
    found = {f["code"]: f["severity"] for f in json.loads(capsys.readouterr().out)["findings"] if f["engine"] == "hf"}
    assert found == {"per-expert-ignored-by-peft": "info"}
    assert cli_main(["doctor", model, a, "--engine", "vllm"]) == 1  # the same file, an engine that misreads it
    capsys.readouterr()

    r = resolve(model, [a], weights=False)
    logged: list[str] = []
    for engines in (["hf"], ["triton", "hf"]):  # run --engine hf; regen of another engine with the hf reference
        preflight(r, engines, logged.append)
    assert logged == []  # not even a warning
    with pytest.raises(SpecError, match=r"vllm-per-expert-interleaved|interleaved"):
        preflight(r, ["vllm"])

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"token_ids": [3 + i, 17, 5, 99, 250, 7, 64, 12 * i]}) + "\n" for i in range(3))
    )
    sel = ["--model", model, "--adapter", a, "--prompts", str(prompts), "--baselines", str(tmp_path / "B")]
    assert cli_main(["regen", *sel]) == 0, capsys.readouterr().err
    assert cli_main(["run", *sel, "--engine", "hf"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "hf:float32-vs-hf:float32" in out and "PASS" in out and "FAIL" not in out


def test_cli_bad_model_is_one_clear_error(tmp_path, capsys):
    assert cli_main(["doctor", "no-such-model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a catalog model" in err and "not a Hub model id" in err and "Traceback" not in err


# -- SGLang 0.5.15 failure modes read in its source (python/sglang/srt/, cited in harness/doctor.py) ----------------


@pytest.mark.parametrize(
    "groups, code",
    [
        (("self_attn.q_proj",), "q-without-v"),  # KeyError on v_proj while fusing q/k/v: fails to load
        (("self_attn.q_proj", "self_attn.k_proj"), "q-without-v"),  # same: k alone may be missing, v may not
        (("self_attn.v_proj",), "kv-without-q"),  # loads, then no LoRA target matches v_proj: scheduler dies
        (("self_attn.k_proj", "self_attn.v_proj"), "kv-without-q"),  # nothing fused without q
    ],
)
def test_sglang_qkv_needs_q_and_v(zoo, tmp_path, groups, code):
    a = gen(zoo, tmp_path, "tiny-qwen3-moe", groups)
    r = doctor(zoo["tiny-qwen3-moe"][0], a)
    assert r.codes("sglang", "error") == {code} and r.exit_code == 1
    assert "v_proj" in check(r, "sglang", "error", code).fix
    assert r.codes("hf", "error") == r.codes("vllm", "error") == set()  # only SGLang minds


@pytest.mark.parametrize(
    "groups, flagged",
    [
        (("mlp.experts.gate_up_proj",), True),  # no down_proj: SGLang never wraps the experts, expert part dropped
        (("mlp.experts.down_proj",), True),  # no gate/up: same
        (("experts",), False),  # both: wrapped
    ],
)
def test_sglang_experts_need_gate_up_and_down(zoo, tmp_path, groups, flagged):
    a = gen(zoo, tmp_path, "tiny-qwen3-moe", groups, layout="per_expert")
    r = doctor(zoo["tiny-qwen3-moe"][0], a, engines=["sglang"])
    assert ("sglang-experts-half-targeted" in r.codes("sglang", "error")) == flagged


def test_sglang_gpt_oss_gate_and_up_need_one_lora_a(zoo, tmp_path):
    # per-expert adapters converted from PEFT's fused gate_up_proj share A between gate and up: SGLang is right
    from safetensors.torch import load_file, save_file

    spec = zoo["tiny-gpt-oss"][0]
    a = gen(zoo, tmp_path, "tiny-gpt-oss", ("attention", "experts"), layout="per_expert")
    assert "sglang-gpt-oss-gate-up-a" not in doctor(spec, a, engines=["sglang"]).codes()
    # one expert's up_proj gets its own A (as an adapter trained per projection would have): SGLang is wrong
    path = Path(a) / "adapter_model.safetensors"
    t = load_file(str(path))
    key = next(k for k in t if ".experts.1.up_proj.lora_A." in k)
    t[key] = t[key] + 1.0
    save_file(t, str(path))
    f = check(doctor(spec, a, engines=["sglang"]), "sglang", "error", "sglang-gpt-oss-gate-up-a")
    assert f.message.startswith("1 gpt-oss expert(s)")


def test_sglang_refuses_target_modules_pattern(zoo, tmp_path):
    a = hand_written(
        tmp_path / "re",
        {"r": 4, "target_modules": r".*\.(q_proj|v_proj)"},
        lora_keys("model.layers.0.self_attn.q_proj", 4, 128, 128),
    )
    r = doctor(zoo["tiny-qwen3-moe"][0], a)
    assert "list of module names" in check(r, "sglang", "error", "sglang-target-modules-string").fix
    assert r.codes("hf", "error") == set()  # PEFT takes the pattern


# -- what the validation layer refuses, doctor reports (exit 1): the same Problems, engine "all" ----------------------


def _zoo_copy(tmp_path, model="tiny-qwen3-moe", name="attention") -> Path:
    import shutil

    from lpdiff.harness.spec.resolve import zoo_adapters

    shutil.copytree(zoo_adapters(model)[name].path, tmp_path / name)
    return tmp_path / name


def _tensors(d: Path, fn) -> Path:
    from safetensors.torch import load_file, save_file

    save_file(fn(load_file(str(d / "adapter_model.safetensors"))), str(d / "adapter_model.safetensors"))
    return d


def _with_router_target(d: Path) -> Path:
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(
        json.dumps({**cfg, "target_parameters": [*cfg["target_parameters"], "mlp.gate.weight"]})
    )
    return d


@pytest.mark.parametrize(
    "model, name, breaks, code",
    [
        ("tiny-gpt-oss", "attention", lambda d: d, "arch-mismatch"),  # a qwen3_moe adapter on gpt-oss
        ("tiny-qwen3-moe", "attention", lambda d: _tensors(d, lambda t: {}), "empty-adapter"),
        (
            "tiny-qwen3-moe",
            "attention",
            lambda d: _tensors(d, lambda t: {k: v * float("inf") for k, v in t.items()}),
            "non-finite",
        ),
        (
            "tiny-qwen3-moe",
            "attention",
            lambda d: _tensors(
                d, lambda t: {k: v[:4].contiguous() if ".lora_A." in k else v[:, :4].contiguous() for k, v in t.items()}
            ),
            "rank-mismatch",
        ),
        (
            "tiny-qwen3-moe",
            "attention",
            lambda d: _tensors(d, lambda t: {k: torch.cat([v, v], 1) if ".lora_A." in k else v for k, v in t.items()}),
            "shape-mismatch",
        ),
        ("tiny-qwen3-moe", "experts", _with_router_target, "target-without-tensors"),
    ],
    ids=["arch", "empty", "non-finite", "rank", "shape", "target-without-tensors"],
)
def test_doctor_reports_what_a_run_refuses(tmp_path, model, name, breaks, code):
    from lpdiff.harness.spec.catalog import get_model

    bad = breaks(_zoo_copy(tmp_path, name=name))
    r = doctor(get_model(model), bad, engines=["hf"])
    assert str(bad) in check(r, "all", "error", code).message and r.exit_code == 1


# -- the hybrids: each engine's LoRA modules for Qwen3.5 / Nemotron-H, read in SGLang 0.5.15 / vLLM 0.25.1 source ---


def _zoo_adapter(model: str, name: str) -> str:
    from lpdiff.harness.spec.resolve import zoo_adapters

    return str(zoo_adapters(model)[name].path)


@pytest.mark.parametrize(
    "name, bad",
    [
        ("linear_attention", "in_proj_a, in_proj_b, in_proj_qkv, in_proj_z"),  # HF's GDN names: no get_hidden_dim entry
        ("attention", None),  # q_proj (with the output gate), k/v/o_proj: SGLang's qkv_proj / o_proj
        ("shared_expert", None),  # shared_expert gate/up/down: SGLang's gate_up_proj / down_proj
    ],
)
def test_sglang_qwen35_lora_modules(name, bad):
    from lpdiff.harness.spec.catalog import get_model

    r = doctor(get_model("tiny-qwen3.5-moe"), _zoo_adapter("tiny-qwen3.5-moe", name), engines=["sglang"])
    if bad is None:
        assert "sglang-unsupported-target" not in r.codes()
        return
    f = check(r, "sglang", "error", "sglang-unsupported-target")
    assert f"no LoRA for {bad} on qwen3_5_moe_text" in f.message and "out_proj" not in f.message.split("(")[0]
    assert "in_proj_qkvz" in f.fix and "in_proj_b" in f.fix


@pytest.mark.parametrize(
    "name, flagged",
    [
        ("shared_expert", True),
        ("mlp", True),  # up_proj tensors: 'Cannot find target module name' at the first batch
        ("attention", False),
        ("mamba", False),
    ],
)
def test_sglang_nemotron_shared_up_proj(name, flagged):
    """Outside the routed experts, up_proj needs lora_target_modules=['all'], which lpdiff's engine sets: info."""
    from lpdiff.harness.spec.catalog import get_model

    r = doctor(get_model("tiny-nemotron-h"), _zoo_adapter("tiny-nemotron-h", name), engines=["sglang"])
    assert "sglang-nemotron-up-proj" not in r.codes("sglang")
    assert ("sglang-nemotron-shared-up-proj" in r.codes("sglang", "info")) == flagged
    if flagged:
        f = check(r, "sglang", "info", "sglang-nemotron-shared-up-proj")
        assert "up_proj" in f.message and "lora_target_modules=['all']" in f.fix


@pytest.mark.parametrize("layout, flagged", [("per_expert", True), ("per_expert_gate", False)])
def test_sglang_nemotron_per_expert_up_proj(zoo, tmp_path, layout, flagged):
    # the measured failure: per-expert keys mixer.experts.{e}.up_proj on the non-gated experts; per_expert_gate
    # names them gate_proj, as SGLang reads them
    a = gen(zoo, tmp_path, "tiny-nemotron-h", ("experts",), layout="per_expert")
    if layout != "per_expert":
        from lpdiff.harness.spec.adapters import convert_adapter

        a = convert_adapter(a, tmp_path / layout, layout, zoo["tiny-nemotron-h"][1].config).path
    r = doctor(zoo["tiny-nemotron-h"][0], a, engines=["sglang"])
    assert ("sglang-nemotron-up-proj" in r.codes("sglang", "error")) == flagged
    if flagged:
        f = check(r, "sglang", "error", "sglang-nemotron-up-proj")
        assert "experts.0.up_proj" in f.message and "experts.N.gate_proj" in f.fix and "per_expert_gate" in f.fix


def test_sglang_nemotron_mamba_in_proj():
    from lpdiff.harness.spec.catalog import get_model

    r = doctor(get_model("tiny-nemotron-h"), _zoo_adapter("tiny-nemotron-h", "mamba"))
    f = check(r, "sglang", "error", "sglang-mamba-in-proj")
    assert "mixer.in_proj" in f.message and "x_proj" in f.fix
    assert r.codes("vllm", "error") == set() and r.codes("hf", "error") == set()  # a full-width in_proj maps there


def test_vllm_nemotron_peft3d_experts(zoo, tmp_path):
    from lpdiff.harness.spec.catalog import get_model

    r = doctor(get_model("tiny-nemotron-h"), _zoo_adapter("tiny-nemotron-h", "experts"), engines=["vllm"])
    assert "--to per_expert" in check(r, "vllm", "error", "vllm-nemotron-peft3d").fix
    per_expert = gen(zoo, tmp_path, "tiny-nemotron-h", ("experts",), layout="per_expert")
    assert "vllm-nemotron-peft3d" not in doctor(zoo["tiny-nemotron-h"][0], per_expert, engines=["vllm"]).codes()
    q = doctor(get_model("tiny-qwen3.5-moe"), _zoo_adapter("tiny-qwen3.5-moe", "experts"), engines=["vllm"])
    # Qwen3.5's class reads PEFT 3D files natively (is_3d_moe_weight); the zoo's text-named file is refused for its
    # names alone (test_text_named_qwen35_adapter_is_refused_for_vllm_and_its_fix_runs)
    assert q.codes("vllm", "error") == {"vllm-qwen3.5-text-names"}


@pytest.mark.parametrize("model", ["tiny-gpt-oss", "tiny-qwen3.5-moe"])
def test_peft3d_on_a_natively_3d_vllm_class_is_not_sent_to_per_expert(zoo, tmp_path, model):
    """gpt-oss and Qwen3.5 read PEFT 3D natively in vLLM 0.25.1 (is_3d_moe_weight): no mixed-format warning, whose
    fix (convert to per-expert) would walk into vllm-per-expert-interleaved / vllm-qwen3.5-per-expert."""
    a = gen(zoo, tmp_path, model, ("attention", "experts"))
    r = doctor(zoo[model][0], a)
    assert not [f for f in r.findings if f.engine == "vllm" and f.code == "peft3d-needs-mixed-format"], r.findings


def test_vllm_drops_nemotron_super_latent_lora(tmp_path):
    """vLLM 0.25.1 wraps Nemotron-Super's fc1/fc2_latent_proj in LoRA layers its MoE runner never calls (measured:
    a latent-only adapter served as the base model): an error for vLLM, nothing for SGLang, which serves them."""
    from lpdiff.harness.spec.catalog import get_model, hf_config

    spec = get_model("nemotron-3-super-120b-a12b", num_layers=2)
    cfg = hf_config(spec)
    moe = cfg.hybrid_override_pattern.index("E")
    h, lat = cfg.hidden_size, cfg.moe_latent_size
    shapes = {
        **lora_keys(f"backbone.layers.{moe}.mixer.fc1_latent_proj", 4, h, lat),
        **lora_keys(f"backbone.layers.{moe}.mixer.fc2_latent_proj", 4, lat, h),
    }
    a = hand_written(tmp_path / "latent", {"r": 4, "target_modules": ["fc1_latent_proj", "fc2_latent_proj"]}, shapes)
    r = doctor(spec, a, engines=["vllm", "sglang"])
    f = check(r, "vllm", "error", "vllm-nemotron-latent-dropped")
    assert f"layers.{moe}.mixer.fc1_latent_proj and 1 more" in f.message and "moe_runner.py" in f.message
    assert r.codes("sglang", "error") == set()
    # the step-size fault is handled by lpdiff's engine: said, as info, for any LoRA on the MoE model
    assert "max_num_batched_tokens=2048" in check(r, "vllm", "info", "vllm-nemotron-step-fault").fix


def test_zero_b_adapter_is_a_no_op_finding(zoo, tmp_path, capsys):
    """PEFT's default init (B = 0) saved untrained: "hf OK" before; now an error for every engine naming the fix.
    The same adapter with init_lora_weights=False (random B) has no such finding."""
    from peft import LoraConfig, get_peft_model

    from lpdiff.harness.cli import main

    spec, model = zoo["tiny-qwen3-moe"]
    for init, d in ((True, tmp_path / "untrained"), (False, tmp_path / "random")):
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
        get_peft_model(copy.deepcopy(model), cfg).save_pretrained(str(d))
    hit = check(doctor(spec, tmp_path / "untrained"), "all", "error", "adapter-no-op")
    assert "every lora_B tensor" in hit.message and "init_lora_weights=False" in hit.fix
    assert "adapter-no-op" not in doctor(spec, tmp_path / "random").codes()
    assert main(["doctor", spec.path, str(tmp_path / "untrained"), "--engine", "hf"]) == 1
    out = capsys.readouterr().out
    assert "no-op" in out and "hf      OK" not in out


def test_adapter_by_zoo_name_or_hub_id(tmp_path, monkeypatch, capsys):
    """`lpdiff doctor MODEL ADAPTER` resolves ADAPTER as `lpdiff run --adapter` does: a zoo name, and a Hub model or
    dataset repo served from an HF cache laid out as huggingface_hub writes it, offline (refused before)."""
    from lpdiff.harness.cli import main
    from lpdiff.harness.spec.resolve import zoo_adapters
    from tests.helpers.hf_cache import offline_home, populate

    hub = offline_home(monkeypatch, tmp_path)
    populate(hub, "acme/my-lora", zoo_adapters("tiny-qwen3-moe")["attention"].path)
    populate(hub, "acme/cases", zoo_adapters("tiny-qwen3-moe")["attention"].path, repo_type="dataset")
    for adapter in ("attention", "acme/my-lora", "hf://datasets/acme/cases"):
        assert main(["doctor", "tiny-qwen3-moe", adapter, "--engine", "hf"]) == 0, capsys.readouterr()
        assert "hf      OK" in capsys.readouterr().out
    assert main(["doctor", "tiny-qwen3-moe", "acme/nope", "--engine", "hf"]) == 2
    assert "hf download acme/nope" in capsys.readouterr().err
