"""engines/sglang/ without SGLang (it cannot run on these machines): launch settings, request building, response
parsing, the HTTP client end to end, and the failure paths (no SGLang, a server that dies) with their messages.

``StandIn`` below is a stand-in for an SGLang server, for the HTTP-client test only: it answers /health and
/generate in SGLang's documented response format, computing the numbers with the real HF engine, so the test checks
what the client sends and what it makes of the answer. It says nothing about SGLang's own numbers.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest

from lpdiff.engines.base import EngineConfig, open_engine
from lpdiff.engines.sglang import (
    MOE_LORA_SETTINGS,
    SGLangEngine,
    generate_request,
    parse_response,
    server_args,
    server_cli,
    sglang_top_k,
)
from lpdiff.engines.subprocess_lane import LaneDied, LaneError
from lpdiff.harness.types import AdapterSpec, ModelSpec

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer dense Qwen3 of the zoo's shape, with one attention adapter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.harness.build.zoo import TINY_CONFIGS
    from lpdiff.harness.spec.adapters import generate_adapter

    root = tmp_path_factory.mktemp("sglang")
    kw = dict(TINY_CONFIGS["tiny-qwen3-dense"], num_hidden_layers=2, initializer_range=0.25)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    model.save_pretrained(str(root / "m"))
    generate_adapter(model, root / "a", groups=("attention",), rank=4, alpha=8, seed=1)
    return ModelSpec(name="m", arch="qwen3", path=str(root / "m")), AdapterSpec("a", str(root / "a"))


# -- settings ------------------------------------------------------------------------------------------------------


def test_server_args_carry_moe_lora_settings_and_adapters(tiny):
    spec, ad = tiny
    args = server_args(
        EngineConfig(model=spec, adapters={"a": ad}, dtype="bfloat16", tp=4), "/ckpt", {"mem_fraction_static": 0.5}
    )
    for k, v in MOE_LORA_SETTINGS.items():
        assert args[k] == v
    assert args["moe_runner_backend"] == "triton"  # gpt-oss LoRA fails with "triton_kernel"
    # the base model takes a LoRA slot of its own in a batch (SGLang 0.5.15 lora_manager.validate_lora_batch)
    assert args["lora_paths"] == {"a": ad.path} and args["max_lora_rank"] == 4 and args["max_loras_per_batch"] == 2
    assert args["tp_size"] == 4 and args["skip_tokenizer_init"] and args["mem_fraction_static"] == 0.5
    assert args["log_level"] == "info" and args["skip_server_warmup"]  # LoRA load lines reach the log tail
    base = server_args(EngineConfig(model=spec, dtype="bfloat16"), "/ckpt")
    assert "enable_lora" not in base and "lora_paths" not in base


@pytest.mark.parametrize(
    "model, want",
    [
        (
            "qwen3.5-35b-a3b",
            {"enable_multimodal": False, "disable_shared_experts_fusion": True},
        ),  # arch qwen3_5_moe_text
        ("nemotron-3-nano-30b-a3b", {"attention_backend": "torch_native", "lora_target_modules": ["all"]}),
    ],
)
def test_arch_settings_reach_the_hybrids(model, want):
    """The catalog's in-memory arch of Qwen3.5 is its text model's: the settings are looked up by checkpoint type."""
    from lpdiff.harness.spec.catalog import get_model

    args = server_args(EngineConfig(model=get_model(model, num_layers=4), dtype="bfloat16"), "/ckpt")
    assert {k: args[k] for k in want} == want


def test_fp32_is_refused_before_anything_starts(tiny):
    with pytest.raises(ValueError, match=r"no fp32 path.*use dtype bfloat16"):
        SGLangEngine(EngineConfig(model=tiny[0], dtype="float32"))


@pytest.mark.parametrize(
    "args, want",
    [
        ({"disable_cuda_graph": True, "enable_lora": False}, ["--disable-cuda-graph"]),  # store_true flags
        ({"lora_paths": {"a": "/x", "b": "/y"}}, ["--lora-paths", "a=/x", "b=/y"]),  # name=path, one adapter each
        ({"tp_size": 8, "lora_backend": "triton"}, ["--tp-size", "8", "--lora-backend", "triton"]),
        ({"lora_target_modules": ["q_proj", "v_proj"]}, ["--lora-target-modules", "q_proj", "v_proj"]),  # nargs
    ],
)
def test_server_cli(args, want):
    assert server_cli(args) == want


# -- requests and responses ------------------------------------------------------------------------------------------


def test_generate_request_picks_adapters_per_prompt_and_topk():
    req = generate_request([[1, 2, 3], [4, 5]], ["a", None], top_k=5, vocab_size=100)
    assert req["input_ids"] == [[1, 2, 3], [4, 5]] and req["lora_path"] == ["a", None]
    assert req["sampling_params"]["max_new_tokens"] == 0 and req["logprob_start_len"] == 0
    assert req["return_logprob"] is True and req["top_logprobs_num"] == 5
    base = generate_request([[1, 2]], [None], top_k=0, vocab_size=100)
    assert "lora_path" not in base and "top_logprobs_num" not in base
    assert generate_request([[1, 2]], [None], top_k=-1, vocab_size=100)["top_logprobs_num"] == 100


@pytest.mark.parametrize("top_k, want", [(0, 0), (7, 7), (-1, 50), (80, 50)])  # whole vocab is its size in SGLang
def test_sglang_top_k(top_k, want):
    assert sglang_top_k(top_k, 50) == want


def test_short_prompt_refused():
    # both SGLang lanes check requests through the engines' shared check before building one
    from lpdiff.engines.base import check_request

    with pytest.raises(ValueError, match="prompt 1 has 1 token"):
        check_request([[1, 2], [3]], None, {})


def sglang_item(ids, lps, tops=None) -> dict:
    """An element of SGLang's answer, as its docs and tokenizer_manager write it (JSON turns tuples into lists)."""
    meta = {"input_token_logprobs": [[None, ids[0], None]] + [[lp, t, None] for lp, t in zip(lps, ids[1:])]}
    if tops is not None:
        meta["input_top_logprobs"] = [None] + [[[lp, t, None] for t, lp in row] for row in tops]
    return {"text": "", "output_ids": [], "meta_info": meta}


def test_parse_response_reads_logprobs_and_sorts_topk():
    tops = [[(9, -2.0), (4, -0.5)], [(1, -0.1), (2, -3.0)]]  # unsorted on purpose
    got = parse_response([3, 4, 1], sglang_item([3, 4, 1], [-0.5, -0.1], tops), top_k=2)
    assert got.logprobs.tolist() == pytest.approx([-0.5, -0.1])
    assert got.topk_ids.tolist() == [[4, 9], [1, 2]]


@pytest.mark.parametrize(
    "item, match",
    [
        ({"meta_info": {}}, "return_logprob=True"),  # the request forgot logprobs
        (sglang_item([3, 4], [-1.0]), "2 input logprobs for a prompt of 3"),  # logprob_start_len was not 0
        (sglang_item([3, 7, 1], [-1.0, -2.0]), r"position 1: 7 != 4.*skip_tokenizer_init"),  # re-tokenized prompt
    ],
)
def test_parse_response_errors(item, match):
    with pytest.raises(ValueError, match=match):
        parse_response([3, 4, 1], item)


def test_parse_response_accepts_sglangs_clipped_last_token_id():
    # SGLang 0.5.15 reports input token ids >= vocab_size - 1 as 0 (logprob_result_processor.py:53)
    item = sglang_item([3, 0, 1], [-1.0, -2.0])
    assert parse_response([3, 99, 1], item, vocab_size=100).logprobs.tolist() == [-1.0, -2.0]
    with pytest.raises(ValueError, match="position 1: 0 != 98"):  # only that id: others still must match
        parse_response([3, 98, 1], item, vocab_size=100)


# -- HTTP end to end against the stand-in server ---------------------------------------------------------------------


class StandIn(BaseHTTPRequestHandler):
    """Stand-in SGLang server (see module docstring): the HF engine computes, the answer has SGLang's shape."""

    engine = None
    requests: ClassVar[list] = []  # every request the stand-in served, shared by the handler instances

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        k = body.get("top_logprobs_num", 0)
        runs = self.engine.prompt_logprobs(body["input_ids"], body.get("lora_path"), top_k=k)
        out = []
        for ids, r in zip(body["input_ids"], runs):
            tops = [list(zip(i.tolist(), v.tolist())) for i, v in zip(r.topk_ids, r.topk_logprobs)] if k else None
            out.append(sglang_item(ids, r.logprobs.tolist(), tops))
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_http_mode_end_to_end(tiny):
    spec, ad = tiny
    prompts, choice = [[1, 5, 9, 200, 17], [7, 7, 100, 2, 250, 31, 4]], ["a", None]
    with open_engine("hf", EngineConfig(model=spec, adapters={"a": ad}, device="cpu")) as hf:
        want = hf.prompt_logprobs(prompts, choice, top_k=3)
        StandIn.engine, StandIn.requests = hf, []
        server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            cfg = EngineConfig(
                model=spec,
                adapters={"a": ad},
                dtype="bfloat16",
                options={"mode": "http", "url": f"http://127.0.0.1:{server.server_port}"},
            )
            with open_engine("sglang", cfg) as eng:
                got = eng.prompt_logprobs(prompts, choice, top_k=3)
        finally:
            server.shutdown()
    (req,) = StandIn.requests
    assert req["lora_path"] == ["a", None] and req["sampling_params"]["max_new_tokens"] == 0
    for g, w in zip(got, want):
        assert np.array_equal(g.token_ids, w.token_ids) and np.allclose(g.logprobs, w.logprobs, atol=1e-6)
        assert np.array_equal(g.topk_ids, w.topk_ids)


# -- failure paths: real processes, no SGLang installed --------------------------------------------------------------


def test_launched_server_that_dies_reports_its_log_tail(tiny):
    cfg = EngineConfig(
        model=tiny[0], dtype="bfloat16", options={"mode": "http", "python": sys.executable, "lane_start_timeout_s": 60}
    )
    with (
        pytest.raises(LaneDied, match="starting the SGLang server: the engine process exited") as err,
        open_engine("sglang", cfg),
    ):
        pass
    assert "No module named 'sglang'" in err.value.log_tail


STAND_IN_SGLANG = """
import json, os, sys
__version__ = "stand-in"

def _log(entry):
    with open(os.environ["STAND_IN_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")

class Engine:  # sgl.Engine's call shape; records what the lane passes and what the lane process has imported
    def __init__(self, **kwargs):
        seen = ("lpdiff.harness.spec.catalog", "transformers")
        _log({"init": kwargs, "imported": sorted(m for m in seen if m in sys.modules)})

    def generate(self, input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num=None,
                 lora_path=None):
        _log({"generate": {"lora_path": lora_path, "sampling_params": sampling_params}})
        return [{"meta_info": {"input_token_logprobs": [[None, ids[0], None]] +
                 [[-0.25 * i, t, None] for i, t in enumerate(ids[1:], 1)]}} for ids in input_ids]

    def shutdown(self):
        _log({"shutdown": True})
"""


def test_offline_lane_gets_resolved_args_and_shuts_the_engine_down(tiny, tmp_path):
    """The lane's child gets ServerArgs resolved by the caller (checkpoint and vocabulary from the caller's
    transformers: the SGLang bundle pins another one), calls sgl.Engine with them, parses its answer and shuts it
    down on close. A stand-in ``sglang`` module (STAND_IN_SGLANG) takes sgl.Engine's place: it says nothing about
    SGLang's numbers."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text(STAND_IN_SGLANG)
    log = tmp_path / "log.jsonl"
    spec, ad = tiny
    cfg = EngineConfig(
        model=spec,
        adapters={"a": ad},
        dtype="bfloat16",
        options={
            "python": sys.executable,
            "lane_start_timeout_s": 60,
            "lane_env": {"PYTHONPATH": str(tmp_path), "STAND_IN_LOG": str(log)},
        },
    )
    with open_engine("sglang", cfg) as eng:
        got = eng.prompt_logprobs([[5, 6, 7]], ["a"])
    assert got[0].logprobs.tolist() == [-0.25, -0.5]
    init, gen, down = (json.loads(line) for line in log.read_text().splitlines())
    assert init["imported"] == []  # the child neither rebuilt the checkpoint nor read lpdiff's catalog
    assert init["init"] == server_args(cfg, spec.path)
    assert gen["generate"] == {"lora_path": ["a"], "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}
    assert down == {"shutdown": True}


def test_offline_without_sglang_says_how_to_install(tiny):
    cfg = EngineConfig(model=tiny[0], dtype="bfloat16", options={"lane_start_timeout_s": 60})
    with (
        pytest.raises(LaneError, match=r"sglang is not installed for .*install sglang==0.5.15"),
        open_engine("sglang", cfg),
    ):
        pass


@pytest.mark.parametrize(
    "options, match",
    [
        ({"lane": "inprocess"}, "always runs in a subprocess lane"),
        ({"mode": "grpc"}, "'offline' or 'http'"),
        ({"server_arg": {}}, r"unknown sglang engine options \['server_arg'\]"),
    ],
)
def test_bad_options(tiny, options, match):
    with pytest.raises(ValueError, match=match):
        SGLangEngine(EngineConfig(model=tiny[0], dtype="bfloat16", options=options))
