#!/usr/bin/env bash
# Lint stage: ruff (lint + format check) over the tree, then mypy over the lpdiff package as the checkout holds it
# (lpdiff/harness, engines, kernels, baselines are symlinks: no install needed to resolve `lpdiff.harness.x`).
# Its own throwaway virtualenv: ruff first (seconds, no dependencies), then lpdiff's dependencies (not lpdiff itself)
# so that mypy reads torch's, transformers' and numpy's types; every linter pinned in constraints.txt.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=.ci/lib.sh
source "$repo/.ci/lib.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$repo"
fresh_venv "$work/venv"

pipq install -q ruff -c constraints.txt
echo "== $(ruff --version)"
ruff check --no-cache .
ruff format --no-cache --check .

# lpdiff's dependencies and the dev extra as pyproject lists them, README's torch first (the CPU build where one is
# on offer), all pinned by constraints.txt; lpdiff itself stays out so that mypy reads the checkout.
python - > "$work/deps.txt" <<'PY'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
PY
pipq install -q triton==3.6.0
pipq install -q torch==2.13.0
pipq install -q -r "$work/deps.txt" -c constraints.txt
echo "== $(mypy --version) | torch $(python -c 'import torch; print(torch.__version__)')"
mypy --cache-dir "$work/mypy_cache"
