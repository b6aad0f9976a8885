"""harness/gpus.py: pytest-xdist workers share out the machine's GPUs (pure assignment on fake GPU lists, then a
real ``pytest -n 2`` with a fake ``nvidia-smi`` on PATH; this machine has no GPU and no driver, so the fake
stands in for the one program the controller and workers ask)."""

import os
import stat
import sys

import pytest

from lpdiff.harness import gpus

pytest_plugins = "pytester"

SMI_4 = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)\n" for i in range(4))
EIGHT = [str(i) for i in range(8)]


def test_parse_nvidia_smi():
    assert gpus.parse_nvidia_smi(SMI_4) == ["0", "1", "2", "3"]
    assert gpus.parse_nvidia_smi("No devices were found\n") == []
    assert gpus.parse_nvidia_smi("  MIG 1g.10gb Device 0: (UUID: MIG-x)\n") == []


def test_machine_gpus_prefers_an_inherited_cuda_visible_devices():
    assert gpus.machine_gpus({"CUDA_VISIBLE_DEVICES": "4, 5,6,7"}, smi=lambda: SMI_4) == ["4", "5", "6", "7"]
    assert gpus.machine_gpus({"CUDA_VISIBLE_DEVICES": ""}, smi=lambda: SMI_4) == []  # hidden on purpose
    assert gpus.machine_gpus({}, smi=lambda: SMI_4) == ["0", "1", "2", "3"]
    assert gpus.machine_gpus({}, smi=lambda: "") == []


@pytest.mark.parametrize(
    "markexpr,k",
    [
        ("gpu1", 1),
        ("gpu4", 4),
        ("gpu1 or gpu2", 2),
        ("not gpu8", 4),
        ("gpu2 and not slow", 2),
        ("cpu", 1),
        ("", 8),
        ("gpu8 or cpu", 8),
    ],
)
def test_gpus_per_case_is_the_largest_selected_marker(markexpr, k):
    assert gpus.gpus_per_case(markexpr) == k


def test_eight_workers_on_eight_gpus_one_each():
    held = [a.held for a in gpus.assignments(EIGHT, 8, gpus.gpus_per_case("gpu1"))]
    assert held == [(str(i),) for i in range(8)]


def test_two_workers_hold_two_sets_of_four():
    a, b = gpus.assignments(EIGHT, 2, gpus.gpus_per_case("gpu4"))
    assert (a.held, b.held) == (("0", "1", "2", "3"), ("4", "5", "6", "7"))
    assert a.line() == "gw0 -> CUDA_VISIBLE_DEVICES=0,1,2,3 (4 GPUs per worker, 8 on this machine, -n 2)"


def test_a_worker_without_a_full_set_holds_none_and_says_why():
    plan = gpus.assignments(EIGHT, 3, 4)
    assert [a.held for a in plan] == [tuple("0123"), tuple("4567"), ()]
    assert plan[2].line().startswith("gw2 -> CUDA_VISIBLE_DEVICES=none")
    assert gpus.skip_reason(4, 0, plan[2]) == (
        "needs 4 GPUs, this machine has 8; xdist worker gw2 holds 0 (-n 3 with 4 per worker: 2 full sets)"
    )
    assert gpus.skip_reason(4, 4, plan[0]) is None


def test_per_worker_count_is_capped_at_the_machine():
    """-m "gpu1 or gpu8" on 4 GPUs: worker 0 holds all four (its gpu1 cases run), the gpu8 cases say the machine
    is short, not the worker."""
    a, b = gpus.assignments(EIGHT[:4], 2, gpus.gpus_per_case("gpu1 or gpu8"))
    assert (a.held, b.held) == (tuple("0123"), ())
    assert gpus.skip_reason(8, 4, a) == "needs 8 GPUs, this machine has 4"
    assert gpus.skip_reason(1, 0, b).startswith("needs 1 GPU, this machine has 4; xdist worker gw1 holds 0")


def test_skip_reason_outside_xdist_and_a_bad_worker_id():
    assert gpus.skip_reason(8, 1, None) == "needs 8 GPUs, this machine has 1"
    assert gpus.skip_reason(2, 2, None) is None
    with pytest.raises(ValueError, match="not an xdist worker id"):
        gpus.worker_index("master")


def test_configure_sets_the_worker_env_and_leaves_others_alone():
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    held = gpus.configure(env, "gpu2", smi=lambda: SMI_4, cores=64)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and held.held == ("2", "3")
    assert env["OMP_NUM_THREADS"] == "32"  # half the cores each, not 64 threads in each of two processes
    env = {
        "PYTEST_XDIST_WORKER": "gw3",
        "PYTEST_XDIST_WORKER_COUNT": "4",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "OMP_NUM_THREADS": "3",
    }
    assert gpus.configure(env, "gpu1", cores=64).held == ("7",) and env["CUDA_VISIBLE_DEVICES"] == "7"
    assert env["OMP_NUM_THREADS"] == "3"  # the user's setting stands
    for env in ({}, {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "2"}):  # not xdist / no GPUs
        assert gpus.configure(env, "gpu1", smi=lambda: "") is None and env.keys() <= {
            "PYTEST_XDIST_WORKER",
            "PYTEST_XDIST_WORKER_COUNT",
        }
    assert gpus.cpu_share(3, cores=2) == 1 and gpus.cpu_share(8, cores=128) == 16


def test_pytest_n2_gives_each_worker_its_own_gpus(pytester, monkeypatch, tmp_path):
    """`pytest -n 2 -m "gpu2 or cpu"` with a fake nvidia-smi listing 4 GPUs: gw0 sees 0,1 and gw1 sees 2,3 in the
    test itself, and the run's output logs one line per worker with its devices."""
    pytest.importorskip("xdist")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({SMI_4!r})\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # as if this test ran in an outer xdist worker: the inner controller inherits its id but is no worker
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    out = tmp_path / "seen"
    out.mkdir()
    # eight quick cpu cases, each recording the worker that ran it and the devices that worker saw; each case
    # waits a little so that both workers get some
    pytester.makepyfile(f"""
        import os, time
        import pytest

        @pytest.mark.cpu
        @pytest.mark.parametrize("i", range(8))
        def test_env(i):
            time.sleep(0.2)
            w = os.environ["PYTEST_XDIST_WORKER"]
            with open(os.path.join({str(out)!r}, w), "w") as f:
                f.write(os.environ["CUDA_VISIBLE_DEVICES"])
        """)
    res = pytester.runpytest_subprocess("-n", "2", "-m", "gpu2 or cpu", "-p", "xdist")
    res.assert_outcomes(passed=8)
    seen = {p.name: p.read_text() for p in out.iterdir()}
    assert seen == {"gw0": "0,1", "gw1": "2,3"}
    res.stdout.fnmatch_lines_random(
        [
            "*lpdiff gpus (plan): gw0 -> CUDA_VISIBLE_DEVICES=0,1 (2 GPUs per worker, 4 on this machine, -n 2)*",
            "*lpdiff gpus: gw0 -> CUDA_VISIBLE_DEVICES=0,1 *",
            "*lpdiff gpus: gw1 -> CUDA_VISIBLE_DEVICES=2,3 *",
        ]
    )
