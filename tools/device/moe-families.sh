#!/usr/bin/env bash
# Batch-1 (and batch-16) decode of the GLM-4.5-Air and gpt-oss-120b shapes with random weights,
# through tools/bench_hybrid_moe.py, each next to its floor measured in the same call (the CPU
# read bandwidth for experts on the pool, the GPU copy bandwidth for every expert on the GPU).
# The shapes are cut to their first GLM_LAYERS / OSS_LAYERS layers so every expert fits on the
# H100 too (the floors count the same layers). gpt-oss has no pool run until the CPU pool
# computes its expert biases and clamped SwiGLU (OSS_FORMATS then, e.g. "int4").
#   bash tools/device_check.sh moe-families        # about 3 min
# Env: GLM_LAYERS (6), OSS_LAYERS (4), GLM_FORMATS ("int4"), OSS_FORMATS (""), BENCH_TIMEOUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_moe_families}
source tools/device/env.sh
rc=0
bench() {  # NAME SHAPE LAYERS FORMATS
  local name=$1 shape=$2 layers=$3 formats=$4 t0 b_rc
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench_hybrid_moe.py --config "tools/shapes/$shape.json" \
    --layers "$layers" --formats $formats --graphs on --gpu-prefill off --decode-steps 32 \
    --batch 16 --prefill 1024 --gpu-all --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  b_rc=$?
  echo "$name ($shape, $layers layers) rc=$b_rc in $(( $(date +%s) - t0 ))s"
  grep -E "^# (CPU|[0-9]+ layers)|^\|" "$OUT/$name.log" | tail -n 8
  [ "$b_rc" -ne 0 ] && { rc=1; tail -n 20 "$OUT/$name.log"; }
}
bench glm_air glm-4.5-air "${GLM_LAYERS:-6}" "${GLM_FORMATS:-int4}"
bench gpt_oss_120b gpt-oss-120b "${OSS_LAYERS:-4}" "${OSS_FORMATS:-}"
exit "$rc"
