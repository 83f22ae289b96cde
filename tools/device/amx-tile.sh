#!/usr/bin/env bash
# Device check of the AMX int8 tiles (ext/cpu/kernels_amx_int8.cpp), in one call:
# - tests: the CPU pool's tests on the AMX machine (parity, batch invariance across VNNI/AMX);
# - models: the pool's model tests there, GPU ones included (CUDA graphs, HF parity; the upcycled
#   SmolLM2 needs the 98 MB model, which does not travel to the device);
# - cross: the crossover with VNNI: 8 experts, top-8 (every expert gets every token), tokens
#   1..32 an expert, TANDEM_AMX_TILE_MIN_TOKENS=1 (tiles always) against a huge value (VNNI
#   only), pool ms per call;
# - ab: the issue's layer (Qwen3-30B-A3B: 2048 / 768, 128 experts, top-8) at AB_TOKENS,
#   this tree against AB_FILES swapped back (tools/device/pool-ab.sh), torch in the same run.
#   AB_FILES=".device-wheels/ab_s8/kernels_amx_int8.cpp:ext/cpu/kernels_amx_int8.cpp ..." \
#     bash tools/device_check.sh amx-tile
# - mixtral: the same A/B on Mixtral-8x7B's layer (4096 / 14336, 8 experts, top-2) at MIX_TOKENS,
#   no torch (big experts: many tokens an expert).
# Env: STAGES ["tests cross ab"; also "models", "mixtral"], AB_FILES (stages ab, mixtral),
#   AB_TOKENS ["8 64 128 256"], MIX_TOKENS ["17 64 256 512"], ROUNDS [1],
#   CROSS_TOKENS ["1 2 4 6 8 12 16 32"], FORMATS ["int8 int4"].
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_amx_tile}
source tools/device/env.sh
rc=0 stages=" ${STAGES:-tests cross ab} "
if [[ $stages == *" tests "* ]]; then
  run_tests cpu_ext 300 tests/ext/test_cpu_pool.py tests/ext/test_cpu_int8_path.py \
    tests/ext/test_packed_rows.py tests/ext/test_expert_cache.py -m "not gpu" || rc=1
fi
if [[ $stages == *" models "* ]]; then
  run_tests models 400 tests/models/test_cpu_pool_cuda.py tests/models/test_cpu_pool_models.py \
    tests/models/test_gpu_experts.py || rc=1
fi
if [[ $stages == *" cross "* ]]; then
  for thr in 1 1000000; do
    echo "== TANDEM_AMX_TILE_MIN_TOKENS=$thr (8 experts, top-8: tokens = tokens an expert)"
    TANDEM_AMX_TILE_MIN_TOKENS=$thr timeout 200 python3 tools/bench_cpu_moe.py --experts 8 --topk 8 \
      --tokens ${CROSS_TOKENS:-1 2 4 6 8 12 16 32} --formats ${FORMATS:-int8 int4} --no-torch --min-time 0.3 \
      >"$OUT/cross.$thr.log" 2>&1 || rc=1
    grep -vE "converted" "$OUT/cross.$thr.log" | tail -n 20
  done
fi
if [[ $stages == *" ab "* ]]; then
  OUT="$OUT/ab" ROUNDS=${ROUNDS:-1} bash tools/device/pool-ab.sh timeout 280 python3 tools/bench_cpu_moe.py \
    --tokens ${AB_TOKENS:-8 64 128 256} --formats ${FORMATS:-int8 int4} --min-time 0.5 || rc=1
fi
if [[ $stages == *" mixtral "* ]]; then
  OUT="$OUT/mixtral" ROUNDS=${ROUNDS:-1} bash tools/device/pool-ab.sh timeout 280 python3 tools/bench_cpu_moe.py \
    --hidden 4096 --inter 14336 --experts 8 --topk 2 --tokens ${MIX_TOKENS:-17 64 256 512} \
    --formats ${FORMATS:-int8 int4} --no-torch --routings 2 --min-time 0.1 || rc=1
fi
exit $rc
