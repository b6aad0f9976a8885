#!/usr/bin/env bash
# GPU run: vLLM 0.25.1 (offline bundle unpacked at $VW, default ~/vw) on a 2-GPU machine, ~9 min.
#   LPDIFF_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu/vllm.sh
source "$(dirname "$0")/common.sh"
VW=${VW:-$HOME/vw}
bash "$VW/unpack.sh" "$VW" || exit 1
export PYTHONPATH=$VW/vsite:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
python -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
step vllm 300 "${PYTEST[@]}" suites/test_engines_gpu.py -k vllm -m gpu1
step metamorphic 200 "${PYTEST[@]}" suites/test_metamorphic.py -k "vllm and full_width" -m gpu1
step vllm 60 "${PYTEST[@]}" suites/test_engines_gpu.py -k "vllm and qwen" -m gpu2
