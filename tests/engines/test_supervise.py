"""engines/supervise.py: a command run under the supervisor gives the caller its own exit status (a signal death
as the negative signal), and ``guarded`` runs the pickled target with its extra arguments after the parent check.
The orphan cases (caller killed) are tests/engines/test_integrity_orphans.py."""

import os
import subprocess
import sys

import pytest

from lpdiff.engines.supervise import supervised_argv


@pytest.mark.parametrize(
    "code,want", [("raise SystemExit(7)", 7), ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15)]
)
def test_the_supervisor_mirrors_the_engines_exit_status(code, want):
    argv = supervised_argv([sys.executable, "-c", code])
    assert argv[:4] == [sys.executable, "-I", "-S", argv[3]] and argv[4] == str(os.getpid()) and argv[5] == "--"
    proc = subprocess.run(argv, start_new_session=True, timeout=60, check=False)
    assert proc.returncode == want


_CHILD = (
    "import pickle, sys; from lpdiff.engines.supervise import guarded; "
    "print(guarded(int(sys.argv[1]), pickle.dumps((divmod, (17,))), 5))"
)


def test_guarded_runs_the_target_with_its_extra_arguments_while_the_parent_lives():
    ok = subprocess.run(
        [sys.executable, "-c", _CHILD, str(os.getpid())], capture_output=True, text=True, timeout=60, check=False
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "(3, 2)", ok.stderr
    # a parent that is not this child's (the parent already gone): exit 1 at once, the target never runs
    gone = subprocess.run([sys.executable, "-c", _CHILD, "1"], capture_output=True, text=True, timeout=60, check=False)
    assert gone.returncode == 1 and gone.stdout == ""
