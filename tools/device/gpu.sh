#!/usr/bin/env bash
# Device check for the CUDA serving path: the GPU tests (full-model parity of the cupy backend
# against the torch backend and HF transformers; the CUDA runner: graphs, no host syncs, seeded
# sampling, KV sizing; overlapped greedy == synchronous), then tools/bench_gpu.py (Tandem vs HF in the same process).
# Run on the device machine from the repository root; logs and JSON go to $OUT. Wheels the image
# lacks (orjson, pytest-asyncio, ...: ../shared/tools/device-wheels.sh) install first with
# `python3 -m pip install --no-index --no-deps .device-wheels/*.whl`.
#   bash tools/device_check.sh gpu [bench_gpu.py arguments...]
# Env: TANDEM_GPU_TESTS (test files; "none" skips), TEST_TIMEOUT, BENCH_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TANDEM_GPU_LOG="$OUT/errors.tsv" PYTHONPATH="$(bash tools/ns_path.sh)${PYTHONPATH:+:$PYTHONPATH}"
: >"$TANDEM_GPU_LOG"
date -u +%FT%TZ | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/device.txt"
python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

tests=${TANDEM_GPU_TESTS:-"tests/ext/test_cuda_attention.py tests/ext/test_skinny_gemm.py tests/ext/test_rms_norm.py tests/ext/test_moe_stage.py tests/ext/test_qk_norm_rope.py tests/models/test_cuda_parity.py tests/runtime/test_cuda_runner.py tests/runtime/test_overlap_gpu.py tests/runtime/test_cuda_sampler.py tests/ext/test_cpu_pool.py tests/models/test_cpu_pool_cuda.py"}
test_rc=0
if [ "$tests" != "none" ]; then
  t0=$(date +%s)
  # addopts replaced: the device image has no pytest-timeout (the `timeout` command bounds it)
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu $tests -p no:cacheprovider \
    -o addopts="-ra --import-mode=importlib" \
    --durations=10 -W ignore::pytest.PytestConfigWarning 2>&1 | tee "$OUT/tests.log"
  test_rc=${PIPESTATUS[0]}
  echo "tests rc=$test_rc in $(( $(date +%s) - t0 ))s"
fi

t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-420}" python3 tools/bench_gpu.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench rc=$bench_rc in $(( $(date +%s) - t1 ))s"

echo "== parity: worst relative error per family (tol 2e-2) =="
sort -t$'\t' -k1,1 -k2,2gr "$TANDEM_GPU_LOG" | awk -F'\t' '!seen[$1]++ {printf "%-45s %s\n", $1, $2}'
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3
sed -n '/== summary/,$p' "$OUT/bench.log"
exit $(( test_rc != 0 || bench_rc != 0 ))
