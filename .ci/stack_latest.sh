#!/usr/bin/env bash
# Stack (b): the CPU suite on the latest releases: the newest CPU build of torch this machine can install (a
# +cpu build where one is on offer, else PyTorch's CPU index), and whatever transformers / peft / triton / the
# rest resolve to with nothing pinned (pip's eager upgrade strategy, so nothing stays at an older release).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=.ci/lib.sh
source "$repo/.ci/lib.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fresh_venv "$work/venv"
t0=$(date +%s)

cpu=$(python -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' | tr ',' '\n' \
      | tr -d ' ' | grep '+cpu$' | head -1 || true)
if [ -n "$cpu" ]; then
  torch_spec="torch==$cpu"
  pipq install -q "$torch_spec"
else
  pipq install -q torch --index-url https://download.pytorch.org/whl/cpu
  torch_spec="torch==$(python -c 'import torch; print(torch.__version__)')"
fi
pipq install -q --upgrade --upgrade-strategy eager "$torch_spec" -e "$repo[dev]"
print_stack "(b) latest"
echo "== stack (b) installed in $(( $(date +%s) - t0 )) s"

cd "$repo"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
run_pytest -n 2
