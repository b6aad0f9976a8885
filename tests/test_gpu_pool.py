"""benchmarks/gpu/pool.py on CPU: jobs share the GPUs they fit on, a job past its limit is killed with its whole
process group, CSVs from several jobs merge under one header, and every job gets one summary line."""
from __future__ import annotations

import shlex
import sys
import tarfile
import time

import pytest

from benchmarks.gpu import pool
from benchmarks.gpu.jobs import JOBS, Job, argv_for

PY = sys.executable
WRITE_CSV = "import os,sys; open(os.environ['LPDIFF_CHECK_CSV_DIR']+'/vllm_gpu.csv','w').write('a,b\\n'+sys.argv[1]+',x\\n')"


def test_pool_runs_side_by_side_kills_overdue_jobs_and_merges(tmp_path, monkeypatch):
    monkeypatch.setenv("LPDIFF_COMMIT", "abc")
    jobs = {
        "one": Job("one", 1, 30, (PY, "-c", WRITE_CSV, "1")),
        "two": Job("two", 1, 30, (PY, "-c", WRITE_CSV, "2")),
        # a child that would outlive its parent: the group kill must take it too
        "hang": Job("hang", 2, 3, ("bash", "-c", "sleep 60 & sleep 60; echo never")),
        "big": Job("big", 4, 30, (PY, "-c", "print('no')")),
    }
    t0 = time.time()
    assert pool.main(["one", "two", "hang", "big", "--gpus", "2", "--out", str(tmp_path), "--deadline-s", "100"],
                     jobs=jobs) == 0
    assert time.time() - t0 < 40, "the overdue job was not stopped at its limit"
    assert (tmp_path / "vllm_gpu.csv").read_text().splitlines() in (["a,b", "1,x", "2,x"], ["a,b", "2,x", "1,x"])
    summary = (tmp_path / "summary.txt").read_text()
    assert "timeout 3s" in summary and "rc=124" in summary
    assert "big" in summary and "needs 4 GPUs, machine has 2" in summary
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        names = tar.getnames()
    assert "jobs/hang/job.log" in names and not any(n.endswith(".csv") for n in names)


def test_pool_refuses_unknown_jobs_and_a_missing_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("LPDIFF_COMMIT", "abc")
    with pytest.raises(SystemExit):
        pool.main(["nope", "--gpus", "1", "--out", str(tmp_path)])
    monkeypatch.setenv("LPDIFF_COMMIT", "")
    with pytest.raises(SystemExit):
        pool.main(["triton-parity", "--gpus", "1", "--out", str(tmp_path)])


def test_every_registered_job_names_a_real_file(tmp_path):
    from benchmarks.gpu.jobs import REPO

    for job in JOBS.values():
        argv = argv_for(job, tmp_path)
        files = [w for a in argv for w in shlex.split(a) if w.endswith(".py")]  # bash -c jobs name them inside
        assert files and all((REPO / f).exists() for f in files), (job.name, argv)
        assert "{dir}" not in " ".join(argv)


def test_vllm_bisect_dry_run_plans_the_sessions(tmp_path):
    """The one-call vLLM bisect (benchmarks/gpu/vllm_qwen3_bisect.py) plans its sessions on the tiny zoo without
    vLLM: each session's LoRA ids, layouts, mixed flag and async scheduling as the GPU run will use them."""
    import subprocess

    from benchmarks.gpu.jobs import REPO

    out = subprocess.run([PY, "benchmarks/gpu/vllm_qwen3_bisect.py", "--dry-run", "--only",
                          "suite-peft3d-async-off,repro", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    heads = [ln for ln in out.splitlines() if ln.startswith(("suite-peft3d-async-off:", "repro:"))]
    assert len(heads) == 2, out
    assert "max_loras 6" in heads[0] and "mixed True" in heads[0] and "async scheduling False" in heads[0]
    assert "max_loras 10" in heads[1] and "async scheduling True" in heads[1]
