#!/usr/bin/env bash
# GPU run: the triton runtime's GPU suites. Sections (default: all) pick what one device call has time for.
#   LPDIFF_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu/triton.sh [parity] [zoo] [detection] [engines] [metamorphic]
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$OUT/gpu.txt"
for section in "${@:-parity zoo detection engines metamorphic}"; do for s in $section; do case $s in
  parity) step triton 200 "${PYTEST[@]}" tests/test_triton_engine_gpu.py -m "gpu1 or gpu2" ;;
  zoo) step triton 120 "${PYTEST[@]}" suites/test_bug_zoo.py -m gpu1 ;;
  detection) step detection 120 python benchmarks/detection.py --full-width qwen3-30b-a3b \
       --full-width gpt-oss-20b --reruns 10 --out "$OUT/detection.csv" ;;
  engines) step triton 200 "${PYTEST[@]}" suites/test_engines_gpu.py -k triton -m "gpu1 or gpu2" ;;
  metamorphic) step metamorphic 200 "${PYTEST[@]}" suites/test_metamorphic.py -k triton -m "gpu1 or gpu2" ;;
  *) echo "unknown section $s"; exit 2 ;;
esac; done; done
