#!/usr/bin/env bash
# GPU run: vLLM 0.25.1 from the offline bundle, whose parts were copied into $VW (default ~/vw) by earlier calls.
#   LPDIFF_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu/vllm.sh
source "$(dirname "$0")/common.sh"
VW=${VW:-$HOME/vw}
bash "$VW/unpack.sh" "$VW" || exit 1
export PYTHONPATH=$VW/vsite:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
python -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
step vllm 300 "${PYTEST[@]}" suites/test_engines_gpu.py -k vllm -m gpu1
LPDIFF_METAMORPHIC_RELATIONS=${QWEN_RELATIONS:-format,rank,factors,gate_up,merged,zero_b,batch,modes} \
  step metamorphic 200 "${PYTEST[@]}" suites/test_metamorphic.py -k "vllm and full_width and qwen" -m gpu1
LPDIFF_METAMORPHIC_RELATIONS=${GPT_OSS_RELATIONS:-format,rank,factors,gate_up,zero_b,batch} \
  step metamorphic 120 "${PYTEST[@]}" suites/test_metamorphic.py -k "vllm and full_width and gpt" -m gpu1
step vllm 120 "${PYTEST[@]}" suites/test_engines_gpu.py -k vllm -m gpu2
