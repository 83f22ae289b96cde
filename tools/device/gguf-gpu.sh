#!/usr/bin/env bash
# Device check for packed GGUF weights on CUDA (issue 23): the GPU tests, the linears at the
# Llama-3-8B shape in both layouts, then random-weight GGUFs of real shapes through the engine
# (batch-1 decode, 2,048-token prefill, STREAMS concurrent streams, floor from the copy
# bandwidth measured in the same process). Logs go to $OUT (default /tmp/tandem_gguf): tests.log,
# engine.log, profiles.txt (few files: the device tool returns at most 8).
#   bash tools/device_check.sh gguf-gpu
#   STAGES="8b-q4_0 8b-q4_k" bash tools/device_check.sh gguf-gpu   # a subset, in this order
# Stages: tests linears 8b-q4_0 8b-q4_k 70b-q4_0 moe-q4_0 (PROFILE=1: a kernel table per model;
# GGUF_DIR keeps the written files, default /tmp/gguf; LINEAR_ARGS / ENGINE_ARGS: more flags
# for tools/bench_gguf_gpu.py, e.g. LINEAR_ARGS=--sweep ENGINE_ARGS=--breakdown).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_gguf}
GGUF_DIR=${GGUF_DIR:-/tmp/gguf}
STAGES=${STAGES:-tests linears 8b-q4_0 8b-q4_k}
STREAMS=${STREAMS:-16}
mkdir -p "$OUT" "$GGUF_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(bash tools/ns_path.sh)${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
rc=0

engine() {  # engine NAME GEN_ARGS...: write the file once, then bench it
  local name=$1 file="$GGUF_DIR/$1.gguf"
  shift
  [ -f "$file" ] || timeout 300 python3 tools/peers/gen_gguf.py "$@" "$file" | tail -n 1
  echo "== $name" >>"$OUT/engine.log"
  timeout 400 python3 tools/bench_gguf_gpu.py --gguf "$file" --streams "$STREAMS" ${ENGINE_ARGS:-} \
    ${PROFILE:+--profile "$OUT/$name-profile.txt"} >>"$OUT/engine.log" 2>&1 || rc=1
  tail -n 2 "$OUT/engine.log"
  [ -f "$OUT/$name-profile.txt" ] && { echo "== $name"; cat "$OUT/$name-profile.txt"; } \
    >>"$OUT/profiles.txt" && rm "$OUT/$name-profile.txt"
}

for stage in $STAGES; do
  t0=$(date +%s)
  echo "== $stage"
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/ext/test_cuda_gguf_tile.py tests/ext/test_cuda_gguf_linear.py \
        tests/ext/test_qk_norm_rope.py tests/ext/test_rms_norm.py tests/models/test_quant_cuda.py \
        >"$OUT/tests.log" 2>&1 || rc=1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 8 ;;
    linears)
      timeout 300 python3 tools/bench_gguf_gpu.py --types Q4_0,Q4_K --reps 10 ${LINEAR_ARGS:-} || rc=1 ;;
    8b-q4_0) engine 8b-q4_0 dense --dense-type q4_0 ;;
    8b-q4_k) engine 8b-q4_k dense --dense-type q4_k ;;
    70b-q4_0) engine 70b-q4_0 dense --dense-type q4_0 --shape 70b ;;
    moe-q4_0) engine moe-q4_0 moe --experts-type q4_0 ;;
    *) echo "unknown stage $stage"; rc=1 ;;
  esac
  echo "$stage: $(( $(date +%s) - t0 ))s"
done
exit "$rc"
