#!/usr/bin/env bash
# One nightly job: the suites of one marker under pytest-xdist, writing junit XML, the JSON verdicts and the HTML
# report under OUT, and a markdown verdict summary to $GITHUB_STEP_SUMMARY (printed when that is unset).
# Usage: .ci/nightly_job.sh MARKER WORKERS OUT [PYTEST ARGS...]   (e.g. gpu2 4 out/; on a CPU box: cpu 2 out/ for a
# dry run; extra arguments narrow the selection, e.g. -k tiny-qwen3-moe)
# Exit status: 1 when an engine named in $LPDIFF_REQUIRE_ENGINES is not installed, else pytest's, else the report's;
# the summary is written whatever happened before it.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: $0 MARKER WORKERS OUT [PYTEST ARGS...]" >&2; exit 2; }
marker=$1 workers=$2 out=$3
shift 3
case "$marker" in cpu|gpu1|gpu2|gpu4|gpu8) ;; *) echo "unknown marker '$marker' (cpu, gpu1, gpu2, gpu4, gpu8)" >&2; exit 2;; esac
case "$workers" in ''|*[!0-9]*) echo "WORKERS must be a number, got '$workers'" >&2; exit 2;; esac
mkdir -p "$out"
# The revision baselines.lock pins (one line hf://datasets/ORG/NAME@COMMIT besides # comments) is the store.
if [ -f baselines.lock ] && [ -z "${LPDIFF_BASELINES:-}" ]; then
  LPDIFF_BASELINES=$(grep -v '^#' baselines.lock)
  export LPDIFF_BASELINES
  echo "baselines: $LPDIFF_BASELINES (baselines.lock)"
fi

# The engines this job names ($LPDIFF_REQUIRE_ENGINES, comma-separated): one that is not installed fails the job
# here, with the command that installs it; the suites then fail its cases too instead of skipping them. Engines the
# job does not name still skip where they are missing.
rc=0
if [ -n "${LPDIFF_REQUIRE_ENGINES:-}" ]; then
  python - <<'PY' || rc=1
import os, sys
from lpdiff.harness.pipeline.session import engine_missing
missing = [why for e in os.environ["LPDIFF_REQUIRE_ENGINES"].split(",") if e.strip() and e.strip() != "all"
           for why in [engine_missing(e.strip())] if why]
for why in missing:
    print(f"FAIL: this job requires it ($LPDIFF_REQUIRE_ENGINES): {why}", file=sys.stderr)
sys.exit(1 if missing else 0)
PY
fi

if [ "$rc" -eq 0 ]; then
  python -m pytest suites -m "$marker" -n "$workers" -p no:cacheprovider -rs \
    --junitxml "$out/junit.xml" --lpdiff-report "$out/verdicts.json" "$@" || rc=$?
  [ "$rc" -eq 5 ] && { echo "pytest collected no tests for -m $marker: that is a failure"; rc=1; }
fi

if [ -f "$out/verdicts.json" ]; then
  report_rc=0
  lpdiff report "$out/verdicts.json" -o "$out/report.html" || report_rc=$?
  [ "$rc" -ne 0 ] || rc=$report_rc
fi

# lpdiff's pytest plugin appends the verdict table to $GITHUB_STEP_SUMMARY itself; this adds the outcome line.
summary=${GITHUB_STEP_SUMMARY:-/dev/stdout}
{
  echo "#### \`pytest suites -m $marker -n $workers\`: exit $rc"
  [ -f "$out/verdicts.json" ] || echo "No verdicts were written (an engine this job requires is missing, pytest stopped early, or no test produced one)."
  echo
} >>"$summary"
exit "$rc"
