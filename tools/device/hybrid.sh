#!/usr/bin/env bash
# Device check of the hybrid MoE path in one call: the GPU tests of the CPU expert pool on CUDA
# (layout and widening kernel, GPU prefill from the pool's weights, the pool inside decode
# graphs, the fused MoE staging), then tools/bench_hybrid_moe.py per expert format with the
# prefill sweep by --gpu-prefill mode. Logs and JSON go to $OUT.
#   bash tools/device_check.sh hybrid            # tests + int4 and bf16 benchmarks (about 4 min)
# Env: HYBRID_TESTS (test files; "none" skips), HYBRID_FORMATS (default "int4 bf16"; "none"),
#      TEST_TIMEOUT, BENCH_TIMEOUT (seconds), BENCH_ARGS (extra bench_hybrid_moe arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_hybrid}
source tools/device/env.sh
rc=0
tests=${HYBRID_TESTS:-"tests/ext/test_layout.py tests/models/test_gpu_prefill.py tests/models/test_cpu_pool_cuda.py tests/ext/test_moe_stage.py"}
if [ "$tests" != "none" ]; then
  # shellcheck disable=SC2086
  run_tests tests "${TEST_TIMEOUT:-240}" -m gpu $tests || rc=1
fi
for fmt in ${HYBRID_FORMATS:-int4 bf16}; do
  [ "$fmt" = none ] && continue
  t0=$(date +%s)
  case "$fmt" in  # lengths around each format's GPU-prefill threshold, and long prompts
    int4) sweep="300 512 1024 4096" ;;
    int8) sweep="300 512 1024" ;;
    *) sweep="512 1024" ;;
  esac
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench_hybrid_moe.py --formats "$fmt" --graphs on \
    --decode-steps 16 --batch 16 --prefill 2048 --prefill-sweep $sweep --gpu-prefill auto off \
    --json "$OUT/hybrid_$fmt.json" ${BENCH_ARGS:-} >"$OUT/hybrid_$fmt.log" 2>&1
  b_rc=$?
  echo "bench $fmt rc=$b_rc in $(( $(date +%s) - t0 ))s"
  grep -E "^#|^\|" "$OUT/hybrid_$fmt.log" | grep -v "profile\|^#   " | tail -n 12
  [ "$b_rc" -ne 0 ] && { rc=1; tail -n 20 "$OUT/hybrid_$fmt.log"; }
done
exit "$rc"
