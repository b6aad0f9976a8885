"""The plain default ``lpdiff run --engine triton`` and the CPU suite's triton lanes catch engine defects that
show only under tensor parallelism or only in one adapter layout (shared-outer, per-expert). The defects are the
tests' own (tests/helpers/defect_hook/lpdiff_test_defects.py), not bug-zoo faults; they reach the TP worker
processes through a sitecustomize on PYTHONPATH, since the workers are fresh interpreters that in-process patching
cannot touch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from lpdiff.harness.cli import main
from lpdiff.harness.commands.run import default_tps, zoo_models
from tests.helpers.paths import HELPERS, REPO

_spec = importlib.util.spec_from_file_location(
    "lpdiff_test_defects", HELPERS / "defect_hook" / "lpdiff_test_defects.py"
)
defects = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(defects)

needs_tp2 = pytest.mark.skipif(
    default_tps("triton") != (1, 2),
    reason="the triton engine's default TP sizes here "
    "are not (1, 2) (a one-GPU machine): the default run has no TP 2 lanes",
)


@pytest.mark.parametrize(
    "gpus, engine, want",
    [
        (0, "triton", (1, 2)),
        (0, "hf", (1,)),
        (0, "vllm", (1,)),
        (1, "triton", (1,)),
        (2, "triton", (1, 2)),
        (8, "vllm", (1, 2)),
        (8, "hf", (1,)),
    ],
)
def test_default_tp_rule(gpus, engine, want, monkeypatch):
    """TP 1 and 2 where the engine declares them and the machine places them: a GPU per rank, or without GPUs the
    engine's cpu_tp (triton's gloo ranks; vLLM runs TP 1 only on CPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert default_tps(engine) == want


def _with_defect(monkeypatch, name: str) -> None:
    """In this process (rank 0) and in every process it starts (the TP workers)."""
    defects.install([name], monkeypatch.setattr)
    for k, v in defects.env([name]).items():
        monkeypatch.setenv(k, v)


def _default_run(tmp_path) -> tuple[int, dict[tuple[str, int, str], list[str]]]:
    """``lpdiff run --engine triton`` with nothing else but a JSON copy of its verdicts: (model, tp, adapter) ->
    the reasons it FAILed ([] = PASS)."""
    out = tmp_path / "verdicts.json"
    rc = main(["run", "--engine", "triton", "--json", str(out)])
    verdicts = json.loads(out.read_text())["verdicts"]
    assert all(v["passed"] == (not v["reasons"]) for v in verdicts)
    return rc, {(v["model"], v["tp"], v["adapter"]): v["reasons"] for v in verdicts}


def _suite_lanes(tmp_path, name: str) -> dict[str, str]:
    """The CPU suite's triton lanes on tiny-qwen3-moe, run by pytest in a fresh process with the defect on:
    test id -> outcome."""
    xml = tmp_path / "suite.xml"
    env = {**os.environ, **defects.env([name])}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-m",
            "cpu",
            f"--junitxml={xml}",
            "suites/test_tiny_zoo.py::test_triton_fp32_matches_hf_baseline",
            "-k",
            "tiny-qwen3-moe",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )  # FAILs expected
    cases = ET.parse(xml).getroot().iter("testcase")
    return {
        c.get("name"): "failed" if c.find("failure") is not None or c.find("error") is not None else "passed"
        for c in cases
    }


@pytest.mark.cpu
@pytest.mark.slow  # a whole default job plus a nested pytest run: 117-122 s on 2 loaded cores
@needs_tp2
def test_default_run_fails_a_tp_only_defect(tmp_path, monkeypatch):
    """Rank 1 counting its all-reduce partial twice: every TP 2 lane FAILs, every TP 1 lane PASSes (the suite's
    own TP 2 lane shows a correct TP 2 run passing)."""
    _with_defect(monkeypatch, "tp_partial_twice")
    rc, got = _default_run(tmp_path)
    assert rc == 1
    served = zoo_models("triton")[0]  # every tiny MoE zoo model the triton engine serves
    assert {(m, tp) for m, tp, _ in got} == {(m, tp) for m in served for tp in (1, 2)}
    assert all(bool(reasons) == (tp == 2) for (_, tp, _), reasons in got.items()), got
    lanes = _suite_lanes(tmp_path, "tp_partial_twice")
    assert lanes == {
        "test_triton_fp32_matches_hf_baseline[tiny-qwen3-moe-tp1]": "passed",
        "test_triton_fp32_matches_hf_baseline[tiny-qwen3-moe-tp2]": "failed",
    }, lanes


# a defect of one adapter layout, the zoo adapter in that layout, and the test that says a file is in it
LAYOUT_DEFECTS = [
    pytest.param("shared_outer_misread", "experts_shared_outer", defects.is_shared_outer, id="shared_outer"),
    pytest.param("per_expert_swapped", "experts_per_expert", defects.is_per_expert, id="per_expert"),
]


@pytest.mark.cpu
@pytest.mark.slow  # the same per layout defect
@needs_tp2
@pytest.mark.parametrize("defect, adapter, _", LAYOUT_DEFECTS)
def test_default_run_fails_a_layout_only_defect(defect, adapter, _, tmp_path, monkeypatch):
    """A loader that misreads one layout (the shared-outer layout's shared factor; two experts' B of a per-expert
    file): that layout's zoo adapter FAILs on both models at both TP sizes on its own logprobs; every other lane
    (base, the other layouts at ranks 4, 8 and 16) is within every threshold on its own, the multi-group "all" lane
    included (a lane is judged on its own delta; the batch's single-group lanes only name the group when its own
    delta fails)."""
    _with_defect(monkeypatch, defect)
    rc, got = _default_run(tmp_path)
    assert rc == 1
    served = zoo_models("triton")[0]  # every tiny MoE zoo model the triton engine serves
    assert {(m, tp) for m, tp, _ in got} == {(m, tp) for m in served for tp in (1, 2)}
    for (model, tp, name), reasons in got.items():
        where = f"{model} tp={tp} {name}: {reasons}"
        if name == adapter:
            assert any(r.startswith("k2 ") for r in reasons), where
        else:
            assert not reasons, where
    lanes = _suite_lanes(tmp_path, defect)
    assert set(lanes.values()) == {"failed"} and len(lanes) == 2, lanes


@pytest.mark.parametrize("_, adapter, is_layout", LAYOUT_DEFECTS)
def test_layout_detection_is_what_the_zoo_holds(_, adapter, is_layout):
    """Each defect keys on the layout itself: the zoo's adapter in that layout is one, its other expert adapters
    are not (else the layout test could pass for the wrong reason)."""
    from lpdiff.harness.spec.adapters import load_canonical
    from lpdiff.harness.spec.catalog import hf_config
    from lpdiff.harness.spec.resolve import resolve

    others = ("experts_shared_outer", "experts_per_expert", "experts", "all")
    r = resolve("tiny-qwen3-moe", adapters=others)
    cfg = hf_config(r.spec)
    got = {n: is_layout(load_canonical(s.path, cfg)) for n, s in r.adapters.items()}
    assert got == {n: n == adapter for n in others}
