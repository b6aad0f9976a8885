"""What a plain install of lpdiff brings: the default job runs the triton engine, so triton is a requirement of the
package on Linux (not only of the dev extra); .ci/wheel_check.sh installs the wheel alone and runs that job."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_triton_is_a_dependency_on_linux_and_loose():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    triton = [d for d in project["dependencies"] if d.split(">")[0].split("=")[0].strip() == "triton"]
    assert triton == ["triton>=3.2; platform_system == 'Linux'"], triton
    assert not any(d.startswith("triton") for extra in project["optional-dependencies"].values() for d in extra)
    assert not any(ln.startswith("triton") for ln in (REPO / "constraints.txt").read_text().splitlines())


def test_wheel_check_runs_the_default_job():
    lines = [ln.split("#")[0].strip() for ln in (REPO / ".ci/wheel_check.sh").read_text().splitlines()]
    assert "lpdiff run" in lines
