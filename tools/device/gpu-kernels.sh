#!/usr/bin/env bash
# Device check for ext/cuda: the GPU kernel tests, then the decode-attention benchmark.
# Run on the device machine from the repository root; logs go to $OUT (default /tmp/tandem_gpu).
#   bash tools/device_check.sh gpu-kernels [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TANDEM_GPU_LOG="$OUT/errors.tsv" PYTHONPATH="$(bash tools/ns_path.sh)${PYTHONPATH:+:$PYTHONPATH}"
: >"$TANDEM_GPU_LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/device.txt"

kexpr=${1:-}
t0=$(date +%s)
timeout 330 python3 -m pytest -q -m gpu tests/ext/test_cuda_attention.py -p no:cacheprovider \
  --durations=8 ${kexpr:+-k "$kexpr"} 2>&1 | tee "$OUT/tests.log"
test_rc=${PIPESTATUS[0]}
echo "tests rc=$test_rc in $(( $(date +%s) - t0 ))s"

t1=$(date +%s)
timeout 200 python3 tools/bench_attention_kernels.py 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench rc=$bench_rc in $(( $(date +%s) - t1 ))s"

echo "== max relative error per shape family (per-token ||out-ref||/||ref||, tol 1e-2) =="
sort -t$'\t' -k1,1 -k2,2gr "$TANDEM_GPU_LOG" | awk -F'\t' '!seen[$1]++ {printf "%-40s %s\n", $1, $2}'
tail -n 14 "$OUT/bench.log"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 3
exit $(( test_rc != 0 || bench_rc != 0 ))
