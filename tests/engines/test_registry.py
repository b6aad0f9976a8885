"""Adding an engine is its module plus one line in engines/registry.py (README "Engines"): with that line alone, the
CLI offers it, the doctor stage checks adapters for it, and ``lpdiff run`` plans and judges it."""

import json
import os
import subprocess
import sys
import textwrap

from tests.helpers.paths import REPO

# the registry line is added before lpdiff's modules load, as it stands in the file for a real engine
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from lpdiff.engines.registry import ENGINES
    ENGINES["fake"] = "tests.helpers.fake_engine:FakeEngine"

    import click
    from lpdiff.harness.cli import cli
    from lpdiff.harness.commands.run import RunRequest, plan, run
    from lpdiff.harness.pipeline.doctor import doctor, refusals
    from lpdiff.harness.pipeline.doctor_facts import ENGINES as DOCTOR_ENGINES
    from lpdiff.harness.spec.resolve import resolve

    choices = {}
    for name, command in cli.commands.items():
        for p in command.params:
            if isinstance(p.type, click.Choice) and "hf" in p.type.choices:
                choices[f"{name} {p.opts[0]}"] = "fake" in p.type.choices
    r = resolve("tiny-qwen3-moe", ("attention",))
    adapter = r.adapters["attention"].path
    p = plan(RunRequest(models=("tiny-qwen3-moe",), engine="fake", adapters=("attention",)))
    report = run(RunRequest(models=("tiny-qwen3-moe",), engine="fake", adapters=("attention",), tps=(1,)))
    print(json.dumps({
        "choices": choices,
        "doctor_engines": list(DOCTOR_ENGINES),
        "doctor": doctor(r.spec, adapter, ["fake"]).engines,
        "refusals": len(refusals(r.spec, adapter, "fake").errors),
        "plan": [(j.engine, j.tp, j.engine_pair) for j in p.jobs],
        "verdicts": [(v.engine_pair, v.adapter, v.passed) for v in report.verdicts],
    }))
    """
)


def test_one_registry_line_adds_an_engine_everywhere():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # every option that names an engine offers it: run/regen --engine and --reference, compare, calibrate, check,
    # metamorphic, doctor
    assert len(got["choices"]) >= 10 and all(got["choices"].values()), got["choices"]
    assert "fake" in got["doctor_engines"] and got["doctor"] == ["fake"] and got["refusals"] == 0
    # HF's capabilities copied: TP 1 only, judged against the stored HF+PEFT references
    assert got["plan"] == [["fake", 1, "fake:float32-vs-hf:float32"]]
    assert [tuple(v) for v in got["verdicts"]] == [
        ("fake:float32-vs-hf:float32", "-", True),
        ("fake:float32-vs-hf:float32", "attention", True),
    ]
