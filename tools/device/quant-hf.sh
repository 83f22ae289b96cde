#!/usr/bin/env bash
# Device check of the GPTQ/AWQ int4 and FP8 linears (ext/cuda/hf_linear.*), in one call:
# - tests: the kernels against dequantize-then-matmul at 1-300 rows, graph capture, tiny GPTQ /
#   AWQ / FP8 models against the same checkpoint dequantized (tests/ext/test_cuda_hf_linear.py);
# - bench: tools/bench_hf_quant_gpu.py (the 8B-shaped linear stack: decode at 1 and 16 rows,
#   2,048-token prefill, against bf16 and the copy-bandwidth floor), into $OUT/bench.json.
# Env: STAGES ["tests bench"], TEST_LIMIT [240] seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_quant_hf}
source tools/device/env.sh
rc=0 stages=" ${STAGES:-tests bench} "
if [[ $stages == *" tests "* ]]; then
  run_tests quant_hf "${TEST_LIMIT:-240}" tests/ext/test_cuda_hf_linear.py \
    tests/models/test_quant_hf_cuda.py -m gpu -x || rc=1
fi
if [[ $stages == *" bench "* ]]; then
  python3 tools/bench_hf_quant_gpu.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" || rc=1
fi
exit "$rc"
