#!/usr/bin/env bash
# Device A/B of the CPU pool's packed int rows (ext/cpu/kernels.h: packed_at) on ONE machine
# instance (instances of the same kind differ by ~1.5x in pool speed, so only same-call
# comparisons mean anything): the pool's CPU tests on this CPU (AMX paths included), then one
# Qwen3-30B-A3B layer (tools/bench_cpu_moe.py) and the end-to-end hybrid model
# (tools/bench_hybrid_moe.py) with TANDEM_CPU_PACK_ROWS=off and =on. Logs and JSON go to $OUT.
#   bash tools/device_check.sh pack            # about 6 min
# Env: PACK_FORMATS (hybrid formats, default "int4"), CPU_TESTS ("none" skips), BENCH_TIMEOUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_pack}
source tools/device/env.sh
rc=0
tests=${CPU_TESTS:-"tests/ext/test_packed_rows.py tests/ext/test_cpu_int8_path.py tests/ext/test_cpu_pool.py tests/ext/test_expert_cache.py"}
if [ "$tests" != "none" ]; then
  # shellcheck disable=SC2086
  run_tests cpu_tests 240 $tests || rc=1
fi
for pack in off on; do
  TANDEM_CPU_PACK_ROWS=$pack timeout "${BENCH_TIMEOUT:-150}" python3 tools/bench_cpu_moe.py \
    --tokens 1 8 64 256 --formats int4 int8 --routings 8 --layers 8 --min-time 0.4 --no-torch --phases \
    --json "$OUT/layer_$pack.json" >"$OUT/layer_$pack.log" 2>&1 || rc=1
  echo "one layer, packed rows $pack:"
  grep -vE "^\s+phases" "$OUT/layer_$pack.log" | tail -n 9
done
for fmt in ${PACK_FORMATS:-int4}; do
  for pack in off on; do
    TANDEM_CPU_PACK_ROWS=$pack timeout "${BENCH_TIMEOUT:-150}" python3 tools/bench_hybrid_moe.py \
      --formats "$fmt" --graphs on --decode-steps 16 --batch 16 --prefill 2048 \
      --prefill-sweep 4096 --gpu-prefill auto --json "$OUT/hybrid_${fmt}_$pack.json" \
      >"$OUT/hybrid_${fmt}_$pack.log" 2>&1 || { rc=1; tail -n 20 "$OUT/hybrid_${fmt}_$pack.log"; }
    echo "hybrid $fmt, packed rows $pack:"
    grep -E "^\| hybrid|^# .*(decode b=1|read bandwidth)" "$OUT/hybrid_${fmt}_$pack.log" | tail -n 6
  done
done
exit "$rc"
