"""The subprocess lane (engines/subprocess_lane.py) that the sglang engine always uses and the vllm engine uses
with ``lane="subprocess"``: an engine that kills its process must become an error with its last log lines, an
engine error must come back with its traceback and leave the lane usable, a hung engine must be killed at the
deadline, closing must end the engine's own subprocesses, and a real engine must give the same numbers in a lane.

The small engines in tests/helpers/lane_targets.py are test doubles for the lane's failure paths (they stand in for
SGLang killing itself);
the last test runs the real HF engine through the lane.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from lpdiff.engines.subprocess_lane import LaneConfig, LaneDied, LaneError, SubprocessLane, lane_config_from_options


def fast_lane(**kw) -> LaneConfig:
    return LaneConfig(start_timeout_s=60, close_timeout_s=10, **kw)


def test_lane_round_trip_and_engine_error_keeps_lane_usable():
    with SubprocessLane("tests.helpers.lane_targets:Doubles", (2.0,), fast_lane()) as lane:
        out = lane.call("echo", [1.0, 2.5])
        assert out["entered"] and out["pid"] != os.getpid() and out["pid"] == lane.info["pid"]
        assert out["arr"].dtype == np.float32 and out["arr"].tolist() == [2.0, 5.0]
        with pytest.raises(LaneError, match="adapter rank 64 > max_lora_rank 16"):
            lane.call("fail")
        assert lane.call("echo", [1.0])["arr"].tolist() == [2.0]
    assert "double: exit" in Path(lane.log_path).read_text(), "close must run the engine's __exit__"


def test_killed_engine_becomes_lane_died_with_log_tail():
    lane = SubprocessLane("tests.helpers.lane_targets:Doubles", (1.0,), fast_lane()).start()
    try:
        with pytest.raises(LaneDied) as err:
            lane.call("die")
        assert err.value.returncode == -signal.SIGKILL
        assert "SIGKILL" in str(err.value) and "skipped 96 expert tensors" in err.value.log_tail
    finally:
        lane.close()


def test_hung_engine_is_killed_at_the_deadline():
    lane = SubprocessLane("tests.helpers.lane_targets:Doubles", (1.0,), fast_lane(call_timeout_s=1.5)).start()
    pid = lane.info["pid"]
    t0 = time.monotonic()
    with pytest.raises(LaneDied, match="did not answer within 2 s"):
        lane.call("hang")
    assert time.monotonic() - t0 < 10
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_close_ends_the_engines_own_subprocesses():
    lane = SubprocessLane("tests.helpers.lane_targets:Doubles", (1.0,), fast_lane()).start()
    grandchild = lane.call("spawn_child")
    os.kill(grandchild, 0)  # alive while the lane runs
    lane.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the engine's subprocess outlived the lane")


def test_bad_target_fails_at_start_with_the_import_error():
    with pytest.raises(LaneError, match="ModuleNotFoundError"):
        SubprocessLane("lpdiff.engines.no_such_engine:X", (), fast_lane()).start()


@pytest.mark.parametrize(
    "options, mode, rest",
    [
        ({}, "inprocess", {}),  # default: no lane
        ({"lane": "subprocess", "max_loras": 2}, "subprocess", {"max_loras": 2}),  # engine options pass through
        ({"python": "/some/other/venv/bin/python"}, "subprocess", {}),  # another interpreter implies a lane
    ],
)
def test_lane_options(options, mode, rest):
    cfg, left = lane_config_from_options(options)
    assert (cfg is None) == (mode == "inprocess") and left == rest
    if "python" in options:
        assert cfg.python == options["python"]


@pytest.mark.parametrize(
    "environ, lane_env, want",
    [
        ({}, None, "0"),  # the lane holds vLLM's engine core: one process (and one import of vLLM) fewer
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, None, None),  # the caller's own setting reaches the lane as it is
        ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "1"),  # so does one given as lane_env
    ],
)
def test_vllm_lane_runs_the_engine_core_in_the_lane(monkeypatch, environ, lane_env, want):
    from lpdiff.engines.base import EngineConfig
    from lpdiff.engines.vllm import VLLMEngine
    from lpdiff.harness.types import ModelSpec

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    options = {"lane": "subprocess", **({"lane_env": lane_env} if lane_env else {})}
    spec = ModelSpec(name="m", arch="qwen3_moe", path="/models/m")  # nothing is read before the engine opens
    eng = VLLMEngine(EngineConfig(model=spec, options=options))
    assert eng.lane_config.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == want
    assert lane_env is None or lane_env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "the caller's dict is not changed"
    assert VLLMEngine(EngineConfig(model=spec)).lane_config is None  # in-process: nothing to set


def test_lane_options_refuse_nonsense():
    with pytest.raises(ValueError, match="'inprocess' or 'subprocess'"):
        lane_config_from_options({"lane": "thread"})
    with pytest.raises(ValueError, match="need lane='subprocess'"):
        lane_config_from_options({"lane": "inprocess", "lane_env": {"A": "1"}})


def test_real_hf_engine_in_a_lane_matches_in_process(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lpdiff.engines.base import EngineConfig
    from lpdiff.engines.hf import HFEngine
    from lpdiff.engines.subprocess_lane import LaneEngine
    from lpdiff.harness.build.zoo import TINY_CONFIGS
    from lpdiff.harness.types import ModelSpec

    kw = dict(TINY_CONFIGS["tiny-qwen3-dense"], num_hidden_layers=2, initializer_range=0.25)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "m"))
    ecfg = EngineConfig(model=ModelSpec(name="m", arch="qwen3", path=str(tmp_path / "m")), device="cpu")
    prompts = [[1, 5, 9, 200, 17], [7, 7, 100, 2, 250, 31, 4]]
    with HFEngine(ecfg) as eng:
        want = eng.prompt_logprobs(prompts, top_k=3)
    with LaneEngine("hf", "lpdiff.engines.hf:HFEngine", ecfg, fast_lane()) as eng:
        got = eng.prompt_logprobs(prompts, top_k=3)
        assert eng.version().startswith("transformers ")
    for g, w in zip(got, want):
        assert np.array_equal(g.token_ids, w.token_ids) and np.allclose(g.logprobs, w.logprobs, atol=1e-6)
        assert np.array_equal(g.topk_ids, w.topk_ids)
