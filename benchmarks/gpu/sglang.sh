#!/usr/bin/env bash
# GPU run: SGLang 0.5.15 (offline bundle unpacked at $SW, default ~/sw) on a 2-GPU machine, ~9 min. SGLang runs
# in a subprocess lane with the bundle on its PYTHONPATH (the bundle pins transformers 5.12.1; HF+PEFT, the
# reference, stays on the image's 5.17 in the parent).
#   LPDIFF_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu/sglang.sh
source "$(dirname "$0")/common.sh"
SW=${SW:-$HOME/sw}
bash "$SW/unpack.sh" "$SW" || exit 1
export LPDIFF_SGLANG_PYTHONPATH=$SW/ssite:$SW/sshim:$PWD
PYTHONPATH=$LPDIFF_SGLANG_PYTHONPATH python -c "import sglang; print('sglang', sglang.__version__)" 2>&1 | tail -1
step sglang 300 "${PYTEST[@]}" suites/test_engines_gpu.py -k sglang -m gpu1
step metamorphic 200 "${PYTEST[@]}" suites/test_metamorphic.py -k "sglang and full_width" -m gpu1
step sglang 60 "${PYTEST[@]}" suites/test_engines_gpu.py -k "sglang and qwen" -m gpu2
