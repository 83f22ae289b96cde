#!/usr/bin/env bash
# Device check of the "gpu" expert backend (every expert on the GPU, models/layers/gpu_experts.py)
# in one call: its GPU tests and the skinny GEMM's (the kernels share one reduction), one
# Qwen3-30B-A3B layer per token count and path (tools/bench_gpu_moe.py), then, per STAGES, the
# whole model with every expert on the GPU next to HF transformers (tools/bench_hybrid_moe.py
# --gpu-all / --hf, one process each) and the CPU pool's conversion time on this CPU. Logs and
# JSON go to $OUT.
#   bash tools/device_check.sh gpu-moe                       # tests + layer: about 4 minutes
#   STAGES="model peer" bash tools/device_check.sh gpu-moe   # 30B model, ours then HF: about 6 minutes
# Env: STAGES ["tests layer convert"], PROMPT [2048] (context of the decode runs), BENCH_TIMEOUT
#   [300], DECODE_KERNELS ["1"]: TANDEM_MOE_DECODE_KERNELS values of the model stage ("1 0": A/B),
#   GPU_EXPERTS [32]: the split stage (the pool with N experts a layer also on the GPU, their
#   share computed densely as before, TANDEM_GPU_EXPERTS_DENSE=1, then by the gpu backend's paths).
#   SHAPES ["mixtral-8x7b:4096:14336:8:2 qwen2-57b-a14b:3584:2560:64:8 gpt-oss:2880:2880:32:4"]:
#   the shapes stage's layers (name:hidden:inter:experts:top-k), each through the CPU pool
#   against torch (bench_cpu_moe.py) and the gpu backend (bench_gpu_moe.py) at SHAPE_TOKENS
#   ["1 3 8 17 64 100 256 512"]; then every SHAPE_CONFIGS ["mixtral-8x7b qwen2-57b-a14b"] model
#   (tools/shapes/NAME.json) cut to SHAPE_LAYERS [8] layers, SHAPE_FORMATS ["int4"] on the pool
#   and all on the GPU, SHAPE_BATCH [16] concurrent; SHAPE_TAG names the logs (A/B runs). An
#   empty SHAPES or SHAPE_FORMATS skips those runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_gpu_moe}
source tools/device/env.sh
rc=0 stages=" ${STAGES:-tests layer convert} " prompt=${PROMPT:-2048} limit=${BENCH_TIMEOUT:-300}
model_args=(--formats --graphs on --decode-steps 24 --batch 16 --prompt "$prompt" --prefill 2048)
if [[ $stages == *" tests "* ]]; then
  run_tests gpu_tests 300 -m gpu tests/models/test_gpu_experts.py tests/ext/test_skinny_gemm.py || rc=1
fi
if [[ $stages == *" layer "* ]]; then
  timeout "$limit" python3 tools/bench_gpu_moe.py --json "$OUT/layer.json" >"$OUT/layer.log" 2>&1 || rc=1
  grep -vE "^# T=" "$OUT/layer.log" | tail -n 16
fi
if [[ $stages == *" convert "* ]]; then  # "converted ... a layer": the pool's load time here
  timeout "$limit" python3 tools/bench_cpu_moe.py --tokens 1 --formats int8 int4 --layers 3 \
    --no-torch --min-time 0.2 --routings 2 >"$OUT/convert.log" 2>&1 || rc=1
  grep -iE "convert|threads|isa" "$OUT/convert.log" | head -n 8
fi
if [[ $stages == *" model "* ]]; then
  for dk in ${DECODE_KERNELS:-1}; do  # TANDEM_MOE_DECODE_KERNELS: 0 routes decode steps in torch
    echo "== every expert on the GPU, TANDEM_MOE_DECODE_KERNELS=$dk =="
    TANDEM_MOE_DECODE_KERNELS=$dk timeout "$limit" python3 tools/bench_hybrid_moe.py \
      "${model_args[@]}" --gpu-all --json "$OUT/gpu_all_dk$dk.json" >"$OUT/gpu_all_dk$dk.log" 2>&1 || rc=1
    grep -E "^gpu_all|^\| gpu_all" "$OUT/gpu_all_dk$dk.log" | cut -c1-400
  done
fi
if [[ $stages == *" peer "* ]]; then
  timeout "$limit" python3 tools/bench_hybrid_moe.py "${model_args[@]}" --hf \
    --json "$OUT/hf.json" >"$OUT/hf.log" 2>&1 || rc=1
  grep -E "^# hf|^\|" "$OUT/hf.log" | tail -n 8
fi
if [[ $stages == *" split "* ]]; then  # cpu_pool with N experts a layer also on the GPU
  for dense in 1 0; do  # TANDEM_GPU_EXPERTS_DENSE=1: the earlier dense share of those experts
    TANDEM_GPU_EXPERTS_DENSE=$dense timeout "$limit" python3 tools/bench_hybrid_moe.py \
      --formats int4 --gpu-experts "${GPU_EXPERTS:-32}" --graphs on --decode-steps 16 --batch 16 \
      --prompt "$prompt" --prefill 2048 --gpu-prefill auto \
      --json "$OUT/split_dense$dense.json" >"$OUT/split_dense$dense.log" 2>&1 || rc=1
    echo "gpu experts ${GPU_EXPERTS:-32}, TANDEM_GPU_EXPERTS_DENSE=$dense:"
    grep -E "^\| hybrid_int4 \|" "$OUT/split_dense$dense.log" || tail -n 3 "$OUT/split_dense$dense.log"
  done
fi
if [[ $stages == *" shapes "* ]]; then  # layer shapes and models the tests do not use
  tokens=(${SHAPE_TOKENS:-1 3 8 17 64 100 256 512})
  for spec in ${SHAPES-mixtral-8x7b:4096:14336:8:2 qwen2-57b-a14b:3584:2560:64:8 gpt-oss:2880:2880:32:4}; do
    IFS=: read -r name h i e k <<<"$spec"
    echo "== layer $name (hidden $h, expert inter $i, $e experts top-$k) =="
    timeout "$limit" python3 tools/bench_cpu_moe.py --hidden "$h" --inter "$i" --experts "$e" \
      --topk "$k" --tokens "${tokens[@]}" --formats bf16 int8 int4 --routings 2 --min-time 0.1 \
      --json "$OUT/shape_cpu_$name.json" >"$OUT/shape_cpu_$name.log" 2>&1 || rc=1
    grep -vE "converted" "$OUT/shape_cpu_$name.log" | tail -n 26
    timeout "$limit" python3 tools/bench_gpu_moe.py --hidden "$h" --inter "$i" --experts "$e" \
      --topk "$k" --tokens "${tokens[@]}" --layers 2 --torch-max-tokens 8 \
      --json "$OUT/shape_gpu_$name.json" >"$OUT/shape_gpu_$name.log" 2>&1 || rc=1
    grep -vE "^# T=" "$OUT/shape_gpu_$name.log" | tail -n 12
  done
  for name in ${SHAPE_CONFIGS-mixtral-8x7b qwen2-57b-a14b}; do
    echo "== model tools/shapes/$name.json, ${SHAPE_LAYERS:-8} layers =="
    timeout "$limit" python3 tools/bench_hybrid_moe.py --config "tools/shapes/$name.json" \
      --layers "${SHAPE_LAYERS:-8}" --formats ${SHAPE_FORMATS-int4} --gpu-all --graphs on \
      --decode-steps 16 --batch "${SHAPE_BATCH:-16}" --prompt "$prompt" --prefill 2048 --gpu-prefill auto \
      --json "$OUT/shape_model_$name${SHAPE_TAG:-}.json" >"$OUT/shape_model_$name${SHAPE_TAG:-}.log" 2>&1 || rc=1
    log="$OUT/shape_model_$name${SHAPE_TAG:-}.log"
    grep -E "^\||^# .*floor at the measured" "$log" || tail -n 5 "$log"
  done
fi
exit $rc
