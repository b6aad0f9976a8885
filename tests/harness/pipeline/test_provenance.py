"""pipeline/provenance.py: the commit stamped on numbers is the checkout's HEAD, LPDIFF_COMMIT wins where set (a
copied tree without git), and a run on the CPU names the CPU whatever GPU the machine has."""

import subprocess

from lpdiff.harness.pipeline.provenance import PACKAGE_ROOT, device_name, git_commit
from tests.helpers.paths import REPO


def test_commit_is_the_checkouts_head_unless_overridden(monkeypatch):
    monkeypatch.delenv("LPDIFF_COMMIT", raising=False)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert PACKAGE_ROOT.resolve() == REPO.resolve()
    assert git_commit() == (head.stdout.strip() if head.returncode == 0 else "unknown")
    monkeypatch.setenv("LPDIFF_COMMIT", "abc1234")
    assert git_commit() == "abc1234"


def test_cpu_work_is_stamped_cpu():
    assert device_name("cpu") == "cpu"
