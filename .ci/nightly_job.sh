#!/usr/bin/env bash
# One nightly job: the suites of one marker under pytest-xdist, then junit XML, the JSON verdicts, the HTML report
# and a markdown verdict summary (appended to $GITHUB_STEP_SUMMARY when set, else printed), all under OUT.
# Usage: .ci/nightly_job.sh MARKER WORKERS OUT   (e.g. gpu2 4 out/; on a CPU box: cpu 2 out/ for a dry run)
# Exit status: pytest's, else the report's; the summary is written whatever happened before it.
set -uo pipefail
[ $# -eq 3 ] || { echo "usage: $0 MARKER WORKERS OUT" >&2; exit 2; }
marker=$1 workers=$2 out=$3
case "$marker" in cpu|gpu1|gpu2|gpu4|gpu8) ;; *) echo "unknown marker '$marker' (cpu, gpu1, gpu2, gpu4, gpu8)" >&2; exit 2;; esac
case "$workers" in ''|*[!0-9]*) echo "WORKERS must be a number, got '$workers'" >&2; exit 2;; esac
mkdir -p "$out"

rc=0
python -m pytest suites -m "$marker" -n "$workers" -p no:cacheprovider -rs \
  --junitxml "$out/junit.xml" --lpdiff-report "$out/verdicts.json" || rc=$?
[ "$rc" -eq 5 ] && { echo "pytest collected no tests for -m $marker: that is a failure"; rc=1; }

if [ -f "$out/verdicts.json" ]; then
  report_rc=0
  lpdiff report "$out/verdicts.json" -o "$out/report.html" || report_rc=$?
  [ "$rc" -ne 0 ] || rc=$report_rc
fi

summary=${GITHUB_STEP_SUMMARY:-/dev/stdout}
python - "$marker" "$out/verdicts.json" "$rc" >>"$summary" <<'PY'
import sys
from pathlib import Path

from tabulate import tabulate

from lpdiff.harness.pipeline.report import VERDICT_HEADERS, outcome, verdict_rows
from lpdiff.harness.pipeline.verdict import from_json

marker, path, rc = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
print(f"## lpdiff nightly `-m {marker}`: pytest exit {rc}\n")
if not path.is_file():
    print("No verdicts were written (pytest stopped before its summary, or no test produced a verdict).")
    sys.exit(0)
vs = from_json(path.read_text())
unexpected = [v for v in vs if outcome(v).endswith("(unexpected)")]
print(f"{len(vs)} verdicts, {len(unexpected)} unexpected (an expected FAIL is a bug-zoo fault or a known defect)\n")


def cell(x):
    return str(x).replace("|", "\\|")


first = sorted(vs, key=lambda v: not outcome(v).endswith("(unexpected)"))  # stable: unexpected ones on top
rows = [[cell(c) for c in r] for r in verdict_rows(first)]
print(tabulate(rows, headers=[cell(h) for h in VERDICT_HEADERS], tablefmt="github", disable_numparse=True))
PY
exit "$rc"
