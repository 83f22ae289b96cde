#!/usr/bin/env bash
# One entry point for the checks and benchmarks run on the GPU machine (docs/device-checks.md).
# Each stage is a script in tools/device/ with its own environment knobs (see its header);
# results go to $OUT (default: a /tmp/tandem_* folder per stage).
#   bash tools/device_check.sh list                     # the stages and what each covers
#   bash tools/device_check.sh STAGE [ARGS...]          # one stage; ARGS go to its script
#   bash tools/device_check.sh STAGE,STAGE,...          # several in order, one device call;
#                                                       # with $OUT set, each writes $OUT/STAGE
# Exit status: 0 when every stage passed, else 1 (2 for an unknown stage).
set -uo pipefail
cd "$(dirname "$0")/.."

stages() {
  cat <<'LIST'
gpu             CUDA serving path: GPU tests (parity, runner, overlap, sampler), then tools/bench_gpu.py vs HF
gpu-kernels     ext/cuda attention kernel tests, then tools/bench_attention_kernels.py
gpu-moe         the "gpu" expert backend: tests, one layer per path; STAGES: model peer split shapes convert
gguf-gpu        packed GGUF on CUDA: tests, 8B linears per layout, 8B/70B/MoE GGUFs through the engine (STAGES)
gpu-serving     `tandem serve` on random weights of a shape, swept by tools/bench_serving.py (--smoke: tiny)
serve-host      `tandem serve` vs the offline engine, 1B shape, 64 and 256 streams (BASE: a before tree)
hybrid          hybrid MoE GPU tests, then tools/bench_hybrid_moe.py per expert format
deepseek        DeepSeek-V3 GPU tests, then the V3 shape hybrid (as many MoE layers as RAM holds)
hybrid-serving  hybrid MoE through `tandem serve` next to the model runner (CONFINES, GPU_ALL, ENGINE)
moe-families    GLM-4.5-Air and gpt-oss-120b shapes: experts on the pool and on the GPU vs their floors
pack            A/B of the CPU pool's packed int rows (TANDEM_CPU_PACK_ROWS off/on)
pool-ab         A/B of a CPU-pool change: a command in this tree and with AB_FILES swapped back
pool-cpu        CPU pool start-up (fill and convert) and its idle spin with the model on the CPU
amx-tile        AMX int8 tiles: pool tests on AMX, VNNI crossover, layer A/Bs (STAGES)
peers-kt        one MoE layer per shape: the CPU pool against kt-kernel (KTransformers), bench_cpu_moe --peer-kt
peers-llama     llama.cpp (CUDA build on the machine) vs Tandem: hybrid MoE decode, 8B Q4_0/Q4_K/bf16, MoE all on the GPU
peers-moe-families  GLM-4.5-Air / gpt-oss-120b cuts: experts on the pool vs llama.cpp -ot exps=CPU on GGUFs of the same shape
quant-hf        GPTQ/AWQ/FP8 CUDA linears: GPU tests, then tools/bench_hf_quant_gpu.py (8B-shaped stack)
packed-experts  MoE experts packed on the GPU (GGUF, MXFP4): tests, layer stacks vs bf16, Q4_0 30B-A3B GGUF via the engine
LIST
}

if [ $# -eq 0 ] || [ "$1" = list ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  echo
  stages
  [ $# -eq 0 ] && exit 2
  exit 0
fi

IFS=, read -r -a wanted <<<"$1"
shift
known=$(stages | awk '{print $1}')
for stage in "${wanted[@]}"; do
  if ! grep -qx -- "$stage" <<<"$known"; then
    echo "device_check: unknown stage '$stage'; known: $(echo $known)" >&2
    exit 2
  fi
done
rc=0
for stage in "${wanted[@]}"; do
  echo "===== $stage ($(date -u +%T) UTC)"
  if [ "${#wanted[@]}" -gt 1 ] && [ -n "${OUT:-}" ]; then
    OUT="$OUT/$stage" bash "tools/device/$stage.sh" "$@" || rc=1
  else
    bash "tools/device/$stage.sh" "$@" || rc=1
  fi
done
exit "$rc"
