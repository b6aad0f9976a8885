#!/usr/bin/env bash
# On a self-hosted GPU runner: a virtualenv that sees the runner's own torch, triton and CUDA libraries
# (--system-site-packages) with lpdiff installed editable on top; its bin/ goes on the job's PATH.
set -euo pipefail
venv="$RUNNER_TEMP/venv"
python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -e ".[dev]"
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
echo "$venv/bin" >> "$GITHUB_PATH"
