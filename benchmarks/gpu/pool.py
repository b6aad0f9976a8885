"""Run GPU jobs side by side on one multi-GPU device machine, each on its own GPUs, inside one call's deadline.

A device call is paid for by wall time, whatever the GPUs do, so independent suites (vLLM, SGLang, triton; one
model each) run at once on separate GPUs instead of one after another. Jobs are named in benchmarks/gpu/jobs.py;
they start in the order given whenever enough GPUs are free (a later job that fits may start before an earlier
one that waits for more GPUs), each under min(its own limit, the time left before the deadline), in its own
process group so that a timed-out engine takes its worker processes with it.

    LPDIFF_COMMIT=<sha> OUT=<dir> python benchmarks/gpu/pool.py --deadline-s 520 JOB [JOB ...]

The device returns at most 8 files from $OUT, so jobs write into a scratch folder and the pool leaves in $OUT:
summary.txt (one line per job), logs.tgz (every job's log and files) and each CSV name the jobs wrote, merged
(`*_gpu.csv`, metamorphic.csv, e2e.csv, ...).
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.jobs import JOBS, Job, argv_for, job_env

MIN_USEFUL_S = 60  # a job given less than this would only pay for its engine start


@dataclass
class Running:
    job: Job
    gpus: list[int]
    proc: subprocess.Popen
    started: float
    limit: float
    log: Path
    done: float | None = None
    rc: int | None = None
    notes: list[str] = field(default_factory=list)


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, check=False,
                         text=True)
    return len(out.stdout.split()) if out.returncode == 0 else 0


def launch(job: Job, gpus: list[int], work: Path, limit: float, threads: int = 8) -> Running:
    jdir = work / job.name
    jdir.mkdir(parents=True, exist_ok=True)
    env = job_env(job, jdir)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    # torch's CPU pools default to every core: six jobs x 64 spinning OpenMP threads on one 64-core host is the
    # likeliest reason run 12's set-up never finished; a share of the cores per job (two jobs may share a GPU)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    log = jdir / "job.log"
    with open(log, "w") as f:
        argv = argv_for(job, jdir)
        f.write(f"# {job.name} on GPUs {gpus}, limit {limit:.0f}s: {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Running(job, gpus, proc, time.time(), limit, log)


def kill_group(r: Running) -> None:
    """SIGTERM, then SIGKILL: engine workers may outlive the leader in its process group."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(r.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            r.proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


def outcome(r: Running) -> str:
    """The log's last pytest summary / verdict lines: what the one-line summary shows."""
    keys = ("passed", "failed", "error", "as expected", "NOT AS EXPECTED", "ok (", "died", "tokens/s")
    lines = [ln.strip() for ln in r.log.read_text(errors="replace").splitlines() if any(k in ln for k in keys)]
    return " | ".join(lines[-3:])[:600]


def merge_outputs(work: Path, out: Path, runs: list[Running], skipped: list[str]) -> None:
    by_name: dict[str, list[Path]] = {}
    for p in sorted(work.rglob("*.csv")):
        by_name.setdefault(p.name, []).append(p)
    for name, paths in by_name.items():
        header, rows = None, []
        for p in paths:
            with open(p, newline="") as f:
                got = list(csv.reader(f))
            if not got:
                continue
            if header is None:
                header = got[0]
            elif got[0] != header:
                rows.append([f"# {p.parent.name}: other columns"] + got[0])
            rows += got[1:]
        with open(out / name, "w", newline="") as f:
            w = csv.writer(f)
            if header:
                w.writerow(header)
            w.writerows(rows)
    def small_text(ti: tarfile.TarInfo):  # logs, reports and profiler traces only: no CSVs (merged above),
        # checkpoints or adapters
        return ti if ti.isdir() or (ti.name.endswith((".log", ".txt", ".trace.json.gz")) and ti.size < 8 << 20) else None

    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        tar.add(work, arcname="jobs", filter=small_text)
    lines = [f"{r.job.name:24s} gpus={','.join(map(str, r.gpus)):8s} {r.done - r.started:6.0f}s rc={r.rc} "
             f"{' '.join(r.notes)} :: {outcome(r)}" for r in runs]
    lines += [f"{name:24s} not started: {why}" for name, why in skipped]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None, jobs: dict[str, Job] = JOBS) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jobs", nargs="+", help=f"job names, in priority order: {', '.join(jobs)}")
    ap.add_argument("--deadline-s", type=float, default=540, help="stop everything after this many seconds")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all nvidia-smi shows)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder whose files come back")
    args = ap.parse_args(argv)
    unknown = [j for j in args.jobs if j not in jobs]
    if unknown:
        ap.error(f"unknown job(s) {unknown}; known: {', '.join(jobs)}")
    if not args.out:
        ap.error("--out (or $OUT) is required")
    os.environ.setdefault("LPDIFF_COMMIT", "")
    if not os.environ["LPDIFF_COMMIT"]:
        ap.error("set LPDIFF_COMMIT to the commit of the copied tree (the device has no git)")
    n_gpus = args.gpus if args.gpus is not None else gpu_count()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lpdiff-pool-"))
    t0 = time.time()
    pending = [jobs[j] for j in args.jobs]
    too_big = [(j.name, f"needs {j.gpus} GPUs, machine has {n_gpus}") for j in pending if j.gpus > n_gpus]
    pending = [j for j in pending if j.gpus <= n_gpus]
    free = list(range(n_gpus))
    running: list[Running] = []
    finished: list[Running] = []
    skipped = list(too_big)
    print(f"[pool] {n_gpus} GPUs, deadline {args.deadline_s:.0f}s, jobs: {' '.join(j.name for j in pending)}",
          flush=True)
    while pending or running:
        now = time.time() - t0
        left = args.deadline_s - now
        for job in list(pending):
            if left < MIN_USEFUL_S:
                skipped += [(j.name, f"only {left:.0f}s left") for j in pending]
                pending.clear()
                break
            if job.gpus <= len(free):
                gpus, free = free[:job.gpus], free[job.gpus:]
                r = launch(job, gpus, work, min(job.limit_s, left - 10),
                           threads=max(2, (os.cpu_count() or 16) // max(2, 2 * n_gpus)))
                running.append(r)
                pending.remove(job)
                print(f"[pool {now:5.0f}s] start {job.name} on GPU {gpus} (limit {r.limit:.0f}s)", flush=True)
        time.sleep(2)
        for r in list(running):
            rc = r.proc.poll()
            if rc is None and time.time() - r.started > r.limit:
                r.notes.append(f"timeout {r.limit:.0f}s")
                rc = 124
            if rc is not None:
                kill_group(r)
                r.rc, r.done = rc, time.time()
                running.remove(r)
                finished.append(r)
                free = sorted(free + r.gpus)
                print(f"[pool {r.done - t0:5.0f}s] end {r.job.name} rc={rc} ({r.done - r.started:.0f}s) "
                      f"{outcome(r)}", flush=True)
    merge_outputs(work, out, finished, skipped)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
