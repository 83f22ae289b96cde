#!/usr/bin/env bash
# GLM-4.5-Air and gpt-oss-120b shapes, cut to their first GLM_LAYERS / OSS_LAYERS layers, with
# the routed experts on the CPU: Tandem's pool (tools/bench_hybrid_moe.py, batch-1 and batch-16
# decode in CUDA graphs next to the floor at the CPU read bandwidth it measures) against
# llama.cpp's llama-bench (-ngl 99 -ot exps=CPU) on GGUFs of the same cut shapes
# (tools/peers/gen_gguf.py glm4moe / gpt-oss: Q4_0 and MXFP4 experts), in one device call.
# llama.cpp's CUDA build (llama-bench only, FlashAttention kernels off to save build time: -fa
# off, which at a few dozen tokens of context costs llama.cpp nothing measurable) runs on cores
# 3-15 while cores 0-2 build Tandem's CPU extension, write the GGUFs and run the families' GPU
# tests (TESTS); every benchmark then runs with all cores.
#   bash tools/peers/llama_cpp.sh fetch            # here, once: .peers/llama.cpp (carry it)
#   bash tools/device_check.sh peers-moe-families  # GPU machine, about 5-6 minutes
# $OUT: summary.txt, glm_int4.json / oss_int4.json / oss_int8.json (Tandem), logs.tgz.
# Env: GLM_LAYERS [6], OSS_LAYERS [4], THREADS [14,16] (llama-bench), TESTS [the gpu tests
#   below], TESTS_UNTIL [240] (s: the tests stop by then), DEADLINE [420] (s: a stage that
#   would end later is skipped; the last is gpt-oss with int8 experts).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_peers_moe}
source tools/device/env.sh
W=$(mktemp -d /tmp/peers-moe.XXXX)
GGUF_DIR=${GGUF_DIR:-/dev/shm/gguf}
mkdir -p "$GGUF_DIR"
T0=$SECONDS DEADLINE=${DEADLINE:-420} last=$(($(nproc) - 1))
say() { echo "[$((SECONDS - T0))s] $*" | tee -a "$W/summary.txt"; }
room() { [ $((DEADLINE - (SECONDS - T0))) -ge "$1" ] || { say "skipped: $2 (needs ${1}s)"; false; }; }
finish() { cp "$W/summary.txt" "$OUT/" 2>/dev/null; tar -czf "$OUT/logs.tgz" -C "$W" .; }
trap finish EXIT

OUT=$W TARGETS=llama-bench LLAMA_CMAKE_ARGS="-DGGML_CUDA_FA=OFF" taskset -c "3-$last" \
  bash tools/peers/llama_cpp.sh build >"$W/build.out" 2>&1 &
build_pid=$!
say "llama.cpp build started on cores 3-$last"
gguf() {  # gguf NAME KIND LAYERS: on cores 1-2
  taskset -c 1,2 python3 tools/peers/gen_gguf.py "$2" "$GGUF_DIR/$1.gguf" --layers "$3" \
    >"$W/gguf_$1.log" 2>&1
  say "gguf $1 rc=$?: $(tail -n 1 "$W/gguf_$1.log")"
}
(gguf glm glm4moe "${GLM_LAYERS:-6}"; gguf oss gpt-oss "${OSS_LAYERS:-4}") &
gguf_pid=$!
taskset -c 0 python3 -c "from tandem.ext.cpu import CpuExpertPool; CpuExpertPool(1).close()" \
  >"$W/ext.log" 2>&1
say "tandem cpu extension rc=$?"
wait "$gguf_pid"
tests=${TESTS-tests/models/test_gpu_prefill_bias.py tests/models/test_moe_families_cuda.py \
tests/runtime/test_window_cuda.py tests/models/test_gpt_oss_pool.py tests/models/test_gpu_prefill.py}
limit=$((${TESTS_UNTIL:-240} - (SECONDS - T0)))  # about when the build ends
if [ -n "$tests" ] && [ "$limit" -gt 30 ]; then
  # shellcheck disable=SC2086
  taskset -c 0-2 timeout "$limit" python3 -m pytest -q -m gpu $tests \
    -p no:cacheprovider -o addopts="-ra --import-mode=importlib" -W ignore::DeprecationWarning \
    >"$W/gpu_tests.log" 2>&1
  say "gpu tests rc=$? (limit ${limit}s)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$W/gpu_tests.log" | tail -n 15 | tee -a "$W/summary.txt"
fi
wait "$build_pid"
say "$(grep -h 'build rc' "$W/llama_cpp.log" 2>/dev/null || tail -n 3 "$W/build.out")"

bench() {  # bench NAME SHAPE LAYERS FORMAT GPU_PREFILL_MODES
  local name=$1 shape=$2 layers=$3 fmt=$4 modes=$5
  room 90 "tandem $name" || return
  # shellcheck disable=SC2086
  timeout 200 python3 tools/bench_hybrid_moe.py --config "tools/shapes/$shape.json" \
    --layers "$layers" --formats "$fmt" --graphs on --gpu-prefill $modes --decode-steps 32 \
    --batch 16 --prefill 1024 --json "$OUT/$name.json" >"$W/tandem_$name.log" 2>&1
  say "tandem $name ($shape, $layers layers, $fmt on the pool) rc=$?"
  grep -E "^# (CPU|[0-9]+ layers)|^\||of its floor" "$W/tandem_$name.log" | tee -a "$W/summary.txt"
}
llama() {  # llama NAME
  local lb=.peers/llama.cpp/build/bin/llama-bench
  [ -x "$lb" ] && room 40 "llama.cpp $1" || return
  timeout 120 "$lb" -m "$GGUF_DIR/$1.gguf" -ngl 99 -ot exps=CPU -fa off \
    -t "${THREADS:-14,16}" -p 0 -n 32 -r 2 -o md >"$W/llama_$1.md" 2>"$W/llama_$1.err"
  say "llama.cpp $1 rc=$?: llama-bench -ngl 99 -ot exps=CPU -fa off -t ${THREADS:-14,16} -p 0 -n 32 -r 2"
  grep -E '^\|' "$W/llama_$1.md" | tee -a "$W/summary.txt"
}
bench glm_int4 glm-4.5-air "${GLM_LAYERS:-6}" int4 off
llama glm
bench oss_int4 gpt-oss-120b "${OSS_LAYERS:-4}" int4 "256 off"
llama oss
bench oss_int8 gpt-oss-120b "${OSS_LAYERS:-4}" int8 "256 off"
