"""The nightly job's command lines (.ci/nightly_job.sh, what .github/workflows/nightly.yml runs per marker) on CPU:
junit XML with the verdicts as properties, the versioned JSON, the HTML report and the step summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET

import pytest

from lpdiff.harness.spec.resolve import zoo_adapters
from tests.helpers.paths import REPO


def test_nightly_job_dry_run_writes_every_artifact(tmp_path):
    out, summary = tmp_path / "out", tmp_path / "summary.md"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary), HF_HUB_OFFLINE="1")
    p = subprocess.run(
        [
            "bash",
            ".ci/nightly_job.sh",
            "cpu",
            "1",
            str(out),
            "-k",
            "test_hf_matches_committed_baseline and tiny-qwen3-moe",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "verdicts.json").read_text())
    n = 1 + len(zoo_adapters("tiny-qwen3-moe"))  # base + every zoo adapter of the model
    assert doc["schema_version"] == 1 and len(doc["verdicts"]) == n
    props = [
        pr.get("value") for pr in ET.parse(out / "junit.xml").iter("property") if pr.get("name") == "lpdiff_verdict"
    ]
    assert len(props) == n and all(json.loads(v)["as_expected"] for v in props)
    html = (out / "report.html").read_text()
    assert "<svg" in html and "tiny-qwen3-moe" in html
    text = summary.read_text()
    assert "### lpdiff verdicts" in text and f"{n} verdicts: {n} as expected, 0 not" in text
    assert "`pytest suites -m cpu -n 1`: exit 0" in text
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = {len(re.split(r"(?<!\\)\|", ln)) for ln in table}  # unescaped pipes split the columns
    assert len(table) == 2 + n and len(cells) == 1, cells


def test_an_engine_the_job_requires_but_lacks_fails_the_job(tmp_path):
    """nightly.yml names every engine it judges ($LPDIFF_REQUIRE_ENGINES): one the runner lacks fails the job with
    the command that installs it, before any suite runs (it used to skip its lanes and leave the night green)."""
    import importlib.util

    if importlib.util.find_spec("sglang"):
        pytest.skip("sglang is installed here")
    out, summary = tmp_path / "out", tmp_path / "summary.md"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary), HF_HUB_OFFLINE="1", LPDIFF_REQUIRE_ENGINES="hf,sglang")
    env.pop("LPDIFF_SGLANG_PYTHONPATH", None)
    env.pop("LPDIFF_SGLANG_PYTHON", None)
    p = subprocess.run(
        ["bash", ".ci/nightly_job.sh", "cpu", "1", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "engine 'sglang' is not installed here: pip install sglang==" in p.stderr
    assert "lpdiff[" not in p.stderr  # lpdiff is not on PyPI: an extra of it installs nothing
    assert "exit 1" in summary.read_text() and not (out / "junit.xml").exists()


def test_nightly_workflow_requires_every_engine_it_judges():
    import yaml

    flow = yaml.safe_load((REPO / ".github/workflows/nightly.yml").read_text())
    named = set(flow["jobs"]["suite"]["env"]["LPDIFF_REQUIRE_ENGINES"].split(","))
    from lpdiff.engines import ENGINES

    assert named == set(ENGINES)


@pytest.mark.parametrize(
    "required, outcome", [("", "skipped"), ("vllm", "failed"), ("all", "failed"), ("sglang", "skipped")]
)
def test_suite_lanes_of_a_missing_engine_fail_only_when_the_job_names_it(required, outcome, monkeypatch):
    """The GPU suites' check: a missing engine skips its cases unless $LPDIFF_REQUIRE_ENGINES names it."""
    import importlib

    from lpdiff.harness.pipeline import session

    monkeypatch.setattr(session, "engine_missing", lambda e: f"engine {e!r} is not installed here: pip install x")
    grid = importlib.import_module("suites.test_engines_gpu")
    monkeypatch.setattr(grid, "engine_missing", session.engine_missing)
    monkeypatch.setenv("LPDIFF_REQUIRE_ENGINES", required)
    with pytest.raises((pytest.skip.Exception, pytest.fail.Exception)) as e:
        grid._installed("vllm")
    assert isinstance(e.value, pytest.skip.Exception if outcome == "skipped" else pytest.fail.Exception)
