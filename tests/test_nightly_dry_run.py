"""The nightly job's command lines (.ci/nightly_job.sh, what .github/workflows/nightly.yml runs per marker) on CPU:
junit XML with the verdicts as properties, the versioned JSON, the HTML report and the step summary."""
from __future__ import annotations

import json
import re
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from lpdiff.harness.spec.resolve import zoo_adapters

REPO = Path(__file__).resolve().parents[1]


def test_nightly_job_dry_run_writes_every_artifact(tmp_path):
    out, summary = tmp_path / "out", tmp_path / "summary.md"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary), HF_HUB_OFFLINE="1")
    p = subprocess.run(["bash", ".ci/nightly_job.sh", "cpu", "1", str(out), "-k",
                        "test_hf_matches_committed_baseline and tiny-qwen3-moe"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "verdicts.json").read_text())
    n = 1 + len(zoo_adapters("tiny-qwen3-moe"))  # base + every zoo adapter of the model
    assert doc["schema_version"] == 1 and len(doc["verdicts"]) == n
    props = [pr.get("value") for pr in ET.parse(out / "junit.xml").iter("property")
             if pr.get("name") == "lpdiff_verdict"]
    assert len(props) == n and all(json.loads(v)["as_expected"] for v in props)
    html = (out / "report.html").read_text()
    assert "<svg" in html and "tiny-qwen3-moe" in html
    text = summary.read_text()
    assert "### lpdiff verdicts" in text and f"{n} verdicts: {n} as expected, 0 not" in text
    assert "`pytest suites -m cpu -n 1`: exit 0" in text
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = {len(re.split(r"(?<!\\)\|", ln)) for ln in table}  # unescaped pipes split the columns
    assert len(table) == 2 + n and len(cells) == 1, cells
