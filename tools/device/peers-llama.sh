#!/usr/bin/env bash
# llama.cpp as the end-to-end peer, next to Tandem on the same shapes, in one device call (about
# 9 minutes). llama.cpp's CUDA build runs on cores 2-15 while the GGUFs are written and Tandem's
# GPU-only figures are taken on cores 0-1 (tools/bench_gguf_gpu.py --gguf on the files llama.cpp
# reads: Llama-3-8B shape in Q4_0 / Q4_K / bf16, the Qwen3-30B-A3B shape with every expert on the
# GPU, whose load dequantizes the experts and needs every core: it runs last). Then, with every
# core: llama-bench hybrid decode (Q4_0 experts, -ngl 99 -ot exps=CPU), `tandem serve` hybrid
# (int4 experts on the CPU pool) at 1 and 16 streams with the CPU floor measured after it
# (tools/device/gpu-serving.sh SHAPE=30B-A3B; needs the llguidance wheel in .device-wheels),
# llama-bench's GPU workloads, and Tandem on the MoE file.
#   bash tools/peers/llama_cpp.sh fetch            # here, once: .peers/llama.cpp (carry it)
#   bash tools/device_check.sh peers-llama         # GPU machine
# $OUT: summary.txt and logs.tgz (every log; the device tool returns at most 8 files).
# Env: GGUFS ["moe-q4_0 dense-q4_0 dense-q4_k dense-bf16"], OWN_GPU ["dense-q4_0 dense-q4_k
#   dense-bf16"], OWN_LAST ["moe-q4_0"], LLAMA_GPU ["dense-q4_0-gpu dense-q4_k-gpu moe-gpu
#   dense-gpu"], HYBRID [1], DEADLINE [575] (s; a stage that would end later is skipped),
#   GGUF_DIR [the roomier of /dev/shm and /tmp], THREADS [14,16] (llama-bench hybrid).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_peers_llama}
source tools/device/env.sh
W=$(mktemp -d /tmp/peers-llama.XXXX)
free_gb() { df -BG --output=avail "$1" 2>/dev/null | tail -n 1 | tr -dc 0-9; }
if [ -z "${GGUF_DIR:-}" ]; then  # the roomier of RAM (/dev/shm) and the disk (/tmp)
  GGUF_DIR=/dev/shm/gguf
  [ "$(free_gb /tmp)" -gt "$(free_gb /dev/shm)" ] && GGUF_DIR=/tmp/gguf
fi
mkdir -p "$GGUF_DIR"
export GGUF_DIR REPS=${REPS:-3} THREADS=${THREADS:-14,16}
T0=$SECONDS DEADLINE=${DEADLINE:-575} last=$(($(nproc) - 1))
say() { echo "[$((SECONDS - T0))s] $*" | tee -a "$W/summary.txt"; }
room() {  # room SECONDS WHAT: true if WHAT's SECONDS still fit before the deadline
  [ $((DEADLINE - (SECONDS - T0))) -ge "$1" ] || { say "skipped: $2 (needs ${1}s)"; false; }
}
finish() { cp "$W/summary.txt" "$OUT/" 2>/dev/null; tar -czf "$OUT/logs.tgz" -C "$W" .; }
trap finish EXIT

OUT=$W TARGETS=llama-bench taskset -c "2-$last" bash tools/peers/llama_cpp.sh build \
  >"$W/build.out" 2>&1 &
build_pid=$!
say "llama.cpp build started on cores 2-$last"
files=${GGUFS-moe-q4_0 dense-q4_0 dense-q4_k dense-bf16}  # 17 + 4.6 + 4.7 + 16 GB
room_gb=$(free_gb "$GGUF_DIR")
say "GGUF files in $GGUF_DIR (${room_gb} GB free)"
if [ "${room_gb:-0}" -lt 46 ] && [[ " $files " == *" dense-bf16 "* ]]; then
  files=${files/dense-bf16/}
  say "skipped: dense-bf16 (too little room for its 16 GB)"
fi
if [ -n "$files" ]; then
  # shellcheck disable=SC2086
  OUT=$W taskset -c 0,1 bash tools/peers/llama_cpp.sh gguf $files >"$W/gguf.out" 2>&1 \
    || say "gguf failed: $(tail -n 3 "$W/gguf.out")"
  say "$(grep -h ggufs "$W/llama_cpp.log")"
fi
streams=()
python3 tools/bench_gguf_gpu.py --help 2>/dev/null | grep -q -- --streams && streams=(--streams 16)
tandem_gguf() {  # tandem_gguf FILE LIMIT [taskset args...]: Tandem's engine on one GGUF file
  local f=$1 limit=$2
  shift 2
  "$@" timeout "$limit" python3 tools/bench_gguf_gpu.py --gguf "$GGUF_DIR/$f.gguf" \
    "${streams[@]}" >"$W/tandem_$f.log" 2>&1
  say "tandem $f rc=$?: $(grep -E "decode|tok/s" "$W/tandem_$f.log" | tail -n 2 | tr '\n' ' ')"
}
for f in ${OWN_GPU-dense-q4_0 dense-q4_k dense-bf16}; do
  [ -f "$GGUF_DIR/$f.gguf" ] || { say "skipped: tandem $f (no file)"; continue; }
  # no later than the build's usual end (about 330 s), so the hybrid part keeps its time
  [ $((SECONDS - T0)) -lt 250 ] || { say "skipped: tandem $f (the build's time is used)"; continue; }
  tandem_gguf "$f" 120 taskset -c 0,1
done
wait "$build_pid"
say "$(grep -h 'build rc' "$W/llama_cpp.log" 2>/dev/null || tail -n 3 "$W/build.out")"
lb=.peers/llama.cpp/build/bin/llama-bench
if [ "${HYBRID:-1}" != 0 ] && [ -x "$lb" ] && room 200 "llama.cpp hybrid"; then
  OUT=$W bash tools/peers/llama_cpp.sh bench moe-hybrid-decode >/dev/null 2>&1
  say "llama.cpp hybrid: $(grep -h 'moe-hybrid-decode rc' "$W/llama_cpp.log")"
  grep -E '^\| qwen' "$W/llama_moe-hybrid-decode.md" | tee -a "$W/summary.txt"
fi
if [ "${HYBRID:-1}" != 0 ] && ! python3 -c "import llguidance" 2>/dev/null; then
  say "skipped: tandem serve hybrid (no llguidance here: add its wheel to .device-wheels)"
elif [ "${HYBRID:-1}" != 0 ] && room 150 "tandem serve hybrid"; then
  OUT=$W/serve SHAPE=30B-A3B EXPERT_FORMAT=int4 INPUT_LEN=128 OUTPUT_LEN=64 CONCURRENCY=1,16 \
    NUM_PROMPTS=4,16 WARMUP=2 MAX_NUM_SEQS=32 START_TIMEOUT=200 BENCH_TIMEOUT=120 \
    timeout $((DEADLINE - (SECONDS - T0))) bash tools/device/gpu-serving.sh >"$W/serve.log" 2>&1
  say "tandem serve hybrid int4 rc=$?"
  if [ -f "$W/serve/summary.txt" ]; then tee -a "$W/summary.txt" <"$W/serve/summary.txt"
  else tail -n 20 "$W/serve.log"; fi
fi
if [ -x "$lb" ]; then
  for name in ${LLAMA_GPU-dense-q4_0-gpu dense-q4_k-gpu moe-gpu dense-gpu}; do
    room 25 "llama.cpp $name" || continue
    OUT=$W bash tools/peers/llama_cpp.sh bench "$name" >/dev/null 2>&1
    say "llama.cpp $name: $(grep -E '^\| (qwen|llama)' "$W/llama_$name.md" | tr -s ' ' | tr '\n' ' ')"
  done
fi
for f in ${OWN_LAST-moe-q4_0}; do
  [ -f "$GGUF_DIR/$f.gguf" ] && room 150 "tandem $f" && tandem_gguf "$f" $((DEADLINE - (SECONDS - T0)))
done
