#!/usr/bin/env bash
# GPU run: SGLang 0.5.15 from the offline bundle (one part, copied to $SW, default ~/sw). SGLang runs in a
# subprocess lane with the bundle on its PYTHONPATH (the bundle pins transformers 5.12.1; HF+PEFT, the reference,
# stays on the image's 5.17 in the parent).
#   LPDIFF_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu/sglang.sh
source "$(dirname "$0")/common.sh"
SW=${SW:-$HOME/sw}
bash "$SW/unpack.sh" "$SW" || exit 1
export LPDIFF_SGLANG_PYTHONPATH=$SW/ssite:$SW/sshim
PYTHONPATH=$LPDIFF_SGLANG_PYTHONPATH python -c "import sglang; print('sglang', sglang.__version__)" 2>&1 | tail -1
step sglang 300 "${PYTEST[@]}" suites/test_engines_gpu.py -k "sglang and not peft3d" -m gpu1
LPDIFF_METAMORPHIC_RELATIONS=${QWEN_RELATIONS:-format,rank,factors,gate_up,merged,zero_b,batch,modes} \
  step metamorphic 200 "${PYTEST[@]}" suites/test_metamorphic.py -k "sglang and full_width and qwen" -m gpu1
step sglang 120 "${PYTEST[@]}" suites/test_engines_gpu.py -k "sglang and peft3d" -m gpu1
LPDIFF_METAMORPHIC_RELATIONS=${GPT_OSS_RELATIONS:-format,rank,factors,gate_up,zero_b,batch} \
  step metamorphic 120 "${PYTEST[@]}" suites/test_metamorphic.py -k "sglang and full_width and gpt" -m gpu1
step sglang 120 "${PYTEST[@]}" suites/test_engines_gpu.py -k sglang -m gpu2
