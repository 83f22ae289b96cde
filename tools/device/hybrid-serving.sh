#!/usr/bin/env bash
# Hybrid MoE through `tandem serve`, next to the model runner on the same machine instance
# (instances of the device differ by up to 1.5x in pool speed, so only same-call figures
# compare): first tools/bench_hybrid_moe.py (the Qwen3-30B-A3B shape, int4 experts, decode
# CUDA graphs, a --prompt-token context), then tools/device/gpu-serving.sh SHAPE=30B-A3B (attention on
# the GPU, every routed expert on the CPU pool) once per TANDEM_POOL_CONFINE value in CONFINES.
# Run on the device from the repository root; everything goes to $OUT.
#   bash tools/device_check.sh hybrid-serving        # about 7 minutes
# Env (defaults in brackets): CONFINES ["off on"], EXPERT_FORMAT [int4], INPUT_LEN [2048],
#   OUTPUT_LEN [128], CONCURRENCY [1,16], NUM_PROMPTS [6,32], RUNNER [1] (0 skips the runner),
#   BENCH_TIMEOUT [200] (s, the runner), ENGINE [0] (1: tools/bench_hybrid_engine.py, the engine
#   without HTTP, after the runner), GPU_ALL [0] (1: then the same shape served with every
#   expert on the GPU, bf16, MOE_EXPERTS=gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_hybrid_serving}
source tools/device/env.sh
fmt=${EXPERT_FORMAT:-int4} in_len=${INPUT_LEN:-2048} rc=0
if [ "${RUNNER:-1}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench_hybrid_moe.py --formats "$fmt" --graphs on \
    --decode-steps 24 --batch 16 --prompt "$in_len" --prefill "$in_len" \
    --json "$OUT/runner.json" >"$OUT/runner.log" 2>&1 || rc=1
  grep -vE "^#   " "$OUT/runner.log" | tail -n 12
fi
if [ "${ENGINE:-0}" != 0 ]; then  # the engine without HTTP: where the serve/runner gap lies
  timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench_hybrid_engine.py --format "$fmt" \
    --prompt "$in_len" --json "$OUT/engine.json" >"$OUT/engine.log" 2>&1 || rc=1
  grep -E "^# hybrid engine|cpu_pool: [0-9]+ MoE" "$OUT/engine.log" || tail -n 5 "$OUT/engine.log"
fi
for confine in ${CONFINES:-off on}; do
  echo "== tandem serve, TANDEM_POOL_CONFINE=$confine =="
  OUT="$OUT/serve-confine-$confine" TANDEM_POOL_CONFINE=$confine SHAPE=30B-A3B \
    EXPERT_FORMAT="$fmt" INPUT_LEN="$in_len" OUTPUT_LEN="${OUTPUT_LEN:-128}" \
    CONCURRENCY="${CONCURRENCY:-1,16}" NUM_PROMPTS="${NUM_PROMPTS:-6,32}" WARMUP=2 \
    MAX_NUM_SEQS=32 START_TIMEOUT=300 BENCH_TIMEOUT=240 \
    bash tools/device/gpu-serving.sh >"$OUT/serve-confine-$confine.log" 2>&1 || rc=1
  grep -E "cpu_pool|model loaded" "$OUT/serve-confine-$confine/server.log"
  cat "$OUT/serve-confine-$confine/summary.txt" 2>/dev/null || tail -n 20 "$OUT/serve-confine-$confine.log"
done
if [ "${GPU_ALL:-0}" != 0 ]; then  # the same shape with every expert on the GPU (bf16), same instance
  echo "== tandem serve, every expert on the GPU =="
  OUT="$OUT/serve-gpu-all" MOE_EXPERTS=gpu SHAPE=30B-A3B INPUT_LEN="$in_len" \
    OUTPUT_LEN="${OUTPUT_LEN:-128}" CONCURRENCY="${CONCURRENCY:-1,16}" NUM_PROMPTS="${NUM_PROMPTS:-6,32}" \
    WARMUP=2 MAX_NUM_SEQS=32 START_TIMEOUT=300 BENCH_TIMEOUT=240 \
    bash tools/device/gpu-serving.sh >"$OUT/serve-gpu-all.log" 2>&1 || rc=1
  grep -E "model loaded|captured" "$OUT/serve-gpu-all/server.log"
  cat "$OUT/serve-gpu-all/summary.txt" 2>/dev/null || tail -n 20 "$OUT/serve-gpu-all.log"
fi
exit $rc
