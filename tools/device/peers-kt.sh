#!/usr/bin/env bash
# KTransformers' own CPU MoE kernels (kt-kernel) against the CPU expert pool, one MoE layer per
# shape in one call: tools/bench_cpu_moe.py --peer-kt on the Qwen3-30B-A3B, DeepSeek-V3 and
# Mixtral-8x7B layers (each shape in its own process: kt-kernel caches its pinned buffers by
# batch size alone), the pool's int4 / int8 / bf16 against kt's AMXINT4 / AMXINT8 / BF16, same
# layer copies, routings and threads, phases on. Needs kt-kernel's files (carry them):
#   bash tools/peers/fetch_kt_kernel.sh .peers/kt      # here, once
#   bash tools/device_check.sh peers-kt                # GPU machine, about 4 minutes
# Env: KT_DIR [.peers/kt], SHAPES ["qwen3-30b-a3b mixtral-8x7b deepseek-v3"], THREADS [14],
#   TOKENS ["1 8 64 256 1024"], FORMATS ["int4 int8 bf16"], MIN_TIME [0.2], ROUTINGS [8],
#   POOL_DEFAULT [1] (after the Qwen3 shape, the pool alone at its default thread count),
#   BENCH_TIMEOUT [240] (s, per shape).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_peers_kt}
source tools/device/env.sh
kt=${KT_DIR:-.peers/kt} rc=0
[ -d "$kt/kt_kernel" ] || { echo "no kt-kernel in $kt: run tools/peers/fetch_kt_kernel.sh"; exit 2; }
python3 tools/peers/cpu_bandwidth.py --threads 1 "${THREADS:-14}" 15 16 2>&1 | tee "$OUT/cpu_bandwidth.txt"
pool_default() {  # the pool alone at its default thread count (cpus - 1), Qwen3 shape
  echo "== qwen3-30b-a3b, the pool alone at its default thread count"
  timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench_cpu_moe.py --shape qwen3-30b-a3b \
    --layers 4 --routings "${ROUTINGS:-8}" --tokens ${TOKENS:-1 8 64 256 1024} \
    --formats ${FORMATS:-int4 int8 bf16} --min-time "${MIN_TIME:-0.2}" --no-torch \
    >"$OUT/pool_default_threads.log" 2>&1 || rc=1
  tail -n 20 "$OUT/pool_default_threads.log"
}
for shape in ${SHAPES:-qwen3-30b-a3b mixtral-8x7b deepseek-v3}; do
  # copies past the 300 MB L3 at 1 token; DeepSeek-V3's experts are drawn 16 and repeated
  case $shape in
    qwen3-30b-a3b) extra=(--layers 4) ;;
    mixtral-8x7b) extra=(--layers 2 --distinct-experts 2) ;;
    deepseek-v3) extra=(--layers 1 --distinct-experts 16) ;;
    *) extra=() ;;
  esac
  echo "== $shape ($(date -u +%T))"
  timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench_cpu_moe.py --shape "$shape" "${extra[@]}" \
    --threads "${THREADS:-14}" --routings "${ROUTINGS:-8}" --tokens ${TOKENS:-1 8 64 256 1024} \
    --formats ${FORMATS:-int4 int8 bf16} --min-time "${MIN_TIME:-0.2}" --no-torch --phases \
    --peer-kt "$kt" >"$OUT/kt_$shape.log" 2>&1 || rc=1
  grep -vE "^\s+phases|NativeMoEWrapper|BF16SafeTensorLoader" "$OUT/kt_$shape.log" | tail -n 40
  # after the first shape, while the machine is as it was for it
  if [ "$shape" = qwen3-30b-a3b ] && [ "${POOL_DEFAULT:-1}" != 0 ]; then pool_default; fi
done
exit $rc
