#!/usr/bin/env bash
# One nightly job: the suites of one marker under pytest-xdist, writing junit XML, the JSON verdicts and the HTML
# report under OUT, and a markdown verdict summary to $GITHUB_STEP_SUMMARY (printed when that is unset).
# Usage: .ci/nightly_job.sh MARKER WORKERS OUT [PYTEST ARGS...]   (e.g. gpu2 4 out/; on a CPU box: cpu 2 out/ for a
# dry run; extra arguments narrow the selection, e.g. -k tiny-qwen3-moe)
# Exit status: pytest's, else the report's; the summary is written whatever happened before it.
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

rc=0
python -m pytest suites -m "$marker" -n "$workers" -p no:cacheprovider -rs \
  --junitxml "$out/junit.xml" --lpdiff-report "$out/verdicts.json" "$@" || rc=$?
[ "$rc" -eq 5 ] && { echo "pytest collected no tests for -m $marker: that is a failure"; rc=1; }

if [ -f "$out/verdicts.json" ]; then
  report_rc=0
  lpdiff report "$out/verdicts.json" -o "$out/report.html" || report_rc=$?
  [ "$rc" -ne 0 ] || rc=$report_rc
fi

# lpdiff's pytest plugin appends the verdict table to $GITHUB_STEP_SUMMARY itself; this adds the outcome line.
summary=${GITHUB_STEP_SUMMARY:-/dev/stdout}
{
  echo "#### \`pytest suites -m $marker -n $workers\`: exit $rc"
  [ -f "$out/verdicts.json" ] || echo "No verdicts were written (pytest stopped early, or no test produced one)."
  echo
} >>"$summary"
exit "$rc"
