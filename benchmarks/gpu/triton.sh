#!/usr/bin/env bash
# GPU run: the triton runtime's GPU suites on a 2-GPU machine (gpu1 + gpu2), ~5 min.
#   LPDIFF_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu/triton.sh
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
step triton 140 "${PYTEST[@]}" tests/test_triton_engine_gpu.py -m "gpu1 or gpu2"
step triton 100 "${PYTEST[@]}" suites/test_bug_zoo.py -m gpu1
step detection 80 python benchmarks/detection.py --full-width qwen3-30b-a3b --full-width gpt-oss-20b \
     --reruns 10 --out "$OUT/detection.csv"
step triton 140 "${PYTEST[@]}" suites/test_engines_gpu.py -k triton -m "gpu1 or gpu2"
step metamorphic 100 "${PYTEST[@]}" suites/test_metamorphic.py -k triton -m "gpu1 or gpu2"
