# Sourced by the GPU run scripts beside it (device machine, repo root as cwd; $OUT = folder whose files come back).
# Each step runs under its own time limit, so that one hung or slow step leaves the call enough time for the
# next, and logs to $OUT/<log>.log (the call's own output keeps only its tail).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
export LPDIFF_COMMIT=${LPDIFF_COMMIT:?set LPDIFF_COMMIT to the commit of the copied tree}
export LPDIFF_CHECK_STORE=${LPDIFF_CHECK_STORE:-$HOME/.cache/lpdiff/check-store}
export LPDIFF_CHECK_CSV_DIR=$OUT LPDIFF_METAMORPHIC_CSV=$OUT/metamorphic.csv
PYTEST=(python -m pytest -p lpdiff.harness.plugin -q -s -W ignore -rs)
T0=$(date +%s)
step() {  # step LOG SECONDS CMD...: run CMD with a time limit, output to $OUT/LOG.log
  local log=$1 limit=$2; shift 2
  echo "=== [$(( $(date +%s) - T0 ))s] $* (limit ${limit}s)" | tee -a "$OUT/$log.log"
  timeout -k 10 "$limit" "$@" >>"$OUT/$log.log" 2>&1
  local rc=$?
  echo "=== [$(( $(date +%s) - T0 ))s] rc $rc" | tee -a "$OUT/$log.log"
  grep -E "passed|failed|error|skipped|as expected|NOT AS EXPECTED" "$OUT/$log.log" | tail -4
}
