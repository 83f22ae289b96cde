#!/usr/bin/env bash
# Builds tools/bench_pool_item.cpp against this tree's ext/cpu kernels (and, given a folder with
# another tree's ext/cpu sources, against those too: an A/B of a kernel change in seconds,
# without building the pool) and sweeps the work items of the issue-26 shapes: K / tokens an
# expert of Qwen3-30B-A3B (2048 / 64), Mixtral-8x7B (4096 / 256, 14336 / 256), DeepSeek-V3
# (7168 / 32) at 1,024 tokens, int4 (groups of 64), int8 and bf16; then CONCURRENT copies at once
# (the pool's load: 14). Needs a CPU with AMX. Env: CONCURRENT [14], OUT_DIR [/tmp/bench_pool_item].
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT_DIR:-/tmp/bench_pool_item}
mkdir -p "$out"
flags=(-O3 -std=c++17 -pthread -DNDEBUG -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl
  -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -mamx-int8 -DTANDEM_HAVE_AVX512
  -DTANDEM_HAVE_VNNI -DTANDEM_HAVE_AMX -DTANDEM_HAVE_AMX_INT8)
units=(kernels_amx_int8.cpp kernels_vnni.cpp kernels_amx.cpp kernels_avx512.cpp kernels_avx2.cpp
  kernels_scalar.cpp)
build() {  # build SRC_DIR BIN [extra flags]
  local src=$1 bin=$2
  shift 2
  (cd "$src" && g++ "${flags[@]}" "$@" -I. "${units[@]}" "$root/tools/bench_pool_item.cpp" -o "$bin")
}
bins=(this)
build "$root/ext/cpu" "$out/this" &
if [[ $# -gt 0 ]]; then
  extra=()
  grep -q "kernels_amx_int8(int fmt);" "$1/kernels.h" && extra=(-DBENCH_ITEM_NO_GROUP)
  build "$1" "$out/other" "${extra[@]}" &
  bins+=(other)
fi
wait
for item in "2048 64 64 5" "4096 256 16 3" "14336 256 4 2" "7168 32 32 5"; do
  for fmt in 2 1 0; do
    for b in "${bins[@]}"; do echo "$b $("$out/$b" $item $fmt)"; done
  done
done
n=${CONCURRENT:-14}
for fmt in 2 1 0; do
  for b in "${bins[@]}"; do
    echo "$b, $n at once, sum of GMAC/s: $(for i in $(seq 0 $((n - 1))); do
      taskset -c "$i" "$out/$b" 4096 256 16 3 $fmt &
    done | awk '{s += $(NF-3)} END {print s}')"
    wait
  done
done
