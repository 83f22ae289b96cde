#!/usr/bin/env bash
# Device check for MoE experts kept packed on the GPU (issues 23, 27): the GPU tests, one MoE
# layer stack per step size (tools/bench_packed_experts.py: Qwen3-30B-A3B shape in Q4_0 and
# gpt-oss-120b shape in MXFP4, each against the same layers in bf16), then the Qwen3-30B-A3B-
# shaped GGUF with Q4_0 experts (tools/peers/gen_gguf.py, llama.cpp's file) through the engine.
#   bash tools/device_check.sh packed-experts
# Env: STAGES ["tests layers engine"], DEADLINE [540] (s; a stage that would end later is skipped),
#   TEST_LIMIT [220], Q4_TOKENS (step sizes of the Q4_0 layers), SKIP_MXFP4, PROFILE (a kernel
#   table of the engine's decode steps in $OUT/profile.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_packed_experts}
source tools/device/env.sh
T0=$SECONDS DEADLINE=${DEADLINE:-540} rc=0
room() { [ $((DEADLINE - (SECONDS - T0))) -ge "$1" ] || { echo "skipped: $2"; false; }; }
for stage in ${STAGES:-tests layers engine}; do
  echo "== $stage at $((SECONDS - T0))s"
  case $stage in
    tests)
      run_tests tests "${TEST_LIMIT:-220}" -m gpu tests/models/test_packed_experts.py \
        tests/ext/test_cuda_moe_quant.py || rc=1 ;;
    layers)
      room 60 "Q4_0 layers" && { timeout 90 python3 tools/bench_packed_experts.py \
        --shape qwen3-30b-a3b --type Q4_0 --bf16 --tokens "${Q4_TOKENS:-1,2,4,8,16,64,300}" \
        --json "$OUT/layers_q4_0.json" || rc=1; }
      [ -n "${SKIP_MXFP4:-}" ] || room 60 "MXFP4 layers" && [ -z "${SKIP_MXFP4:-}" ] && { timeout 90 python3 tools/bench_packed_experts.py \
        --shape gpt-oss-120b --type MXFP4 --layers 4 --bf16 --tokens 1,4,16,300 \
        --json "$OUT/layers_mxfp4.json" || rc=1; }
      ;;
    engine)
      room 120 "engine" || continue
      f=/dev/shm/moe-q4_0.gguf
      [ -f "$f" ] || timeout 120 python3 tools/peers/gen_gguf.py moe "$f" --experts-type q4_0 | tail -n 1
      timeout $((DEADLINE - (SECONDS - T0))) python3 tools/bench_gguf_gpu.py --gguf "$f" \
        --json "$OUT/engine_moe_q4_0.json" ${PROFILE:+--profile "$OUT/profile.txt"} 2>&1 \
        | grep -v Warning | tail -n 5 || rc=1 ;;
  esac
done
exit "$rc"
