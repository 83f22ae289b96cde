#!/usr/bin/env bash
# Device check of DeepSeek-V3 in one call: its GPU tests (HF parity in bf16, the engine over
# the latent cache, the CUDA runner with graphs against eager and against a float32 reference),
# then tools/bench_hybrid_moe.py on the V3 shape (tools/shapes/deepseek-v3.json) cut to its 3
# dense layers + as many MoE layers as the host's RAM holds per expert format (--fit-ram),
# decode at batch 1 and 16 through CUDA graphs and a 4,096-token prefill per --gpu-prefill mode,
# extrapolated to the 61 layers. Logs and JSON go to $OUT.
#   bash tools/device_check.sh deepseek          # tests + int4 and int8 (about 5 min)
# Env: DS_TESTS (test files; "none" skips), DS_FORMATS (default "int4 int8"), DS_LAYERS (cap on
#      the layers, default 15), TEST_TIMEOUT, BENCH_TIMEOUT (seconds), BENCH_ARGS (extra args).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_deepseek}
source tools/device/env.sh
rc=0
tests=${DS_TESTS:-tests/models/test_deepseek_cuda.py}
if [ "$tests" != "none" ]; then
  # shellcheck disable=SC2086
  TANDEM_GPU_LOG="$OUT/deepseek_errors.tsv" run_tests tests "${TEST_TIMEOUT:-180}" -m gpu $tests || rc=1
  cat "$OUT/deepseek_errors.tsv" 2>/dev/null
fi
t0=$(date +%s)
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-360}" python3 tools/bench_hybrid_moe.py \
  --config tools/shapes/deepseek-v3.json --fit-ram --layers "${DS_LAYERS:-15}" \
  --formats ${DS_FORMATS:-int4 int8} --graphs on --decode-steps 16 --batch 16 --prompt 32 \
  --prefill 4096 --gpu-prefill auto off --json "$OUT/deepseek_bench.json" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/deepseek_bench.log" | grep -E "^#|^\||rc=|Error|error" | grep -v "^#   "
b_rc=${PIPESTATUS[0]}
echo "bench rc=$b_rc in $(( $(date +%s) - t0 ))s"
[ "$b_rc" -ne 0 ] && { rc=1; tail -n 30 "$OUT/deepseek_bench.log"; }
exit "$rc"
