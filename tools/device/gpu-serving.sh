#!/usr/bin/env bash
# Issue 4's serving benchmark: `tandem serve` on random bf16 weights of a real shape (default
# "1B" = Llama-3.2-1B), driven by tools/bench_serving.py at concurrency 1, 16, 64 and 256 with
# fixed lengths (256 in / 256 out, token-id prompts, ignore_eos): TTFT and TPOT p50/p99 and
# output tok/s per level, the sweep plot, and a summary table next to the batch-1 decode floor.
# Run on the device from the repository root; everything goes to $OUT.
#   bash tools/device/gpu-serving.sh            # the 1B sweep (about 3 minutes on an H100)
#   bash tools/device/gpu-serving.sh --smoke    # a tiny shape, tiny lengths: checks the script end to end
# SHAPE=30B-A3B (or tiny-moe) serves a Qwen3-30B-A3B-shaped mixture of experts in hybrid mode: attention
# on the GPU, every routed expert on the CPU pool in EXPERT_FORMAT [int4] (random experts are
# made one layer at a time as the pool converts them); its floor is the active expert bytes per
# token over CPU_GBPS [measured after the run by tools/peers/cpu_bandwidth.py at the pool's
# thread count], the CPU read bandwidth, and at concurrency c the experts c tokens
# touch under uniform routing. MOE_EXPERTS=gpu [cpu] keeps every expert on the GPU instead (bf16, the
# "gpu" expert backend); the floor is then the bytes a step reads from GPU memory.
# Env (defaults in brackets; --smoke changes them): SHAPE [1B] (1B | 8B | tiny | 30B-A3B | tiny-moe),
#   MOE_EXPERTS [cpu] (cpu | gpu), INPUT_LEN [256],
#   OUTPUT_LEN [256], CONCURRENCY [1,16,64,256], NUM_PROMPTS [32,64,256,512] (per level),
#   WARMUP [32], DEVICE [auto], PORT [8123], MAX_NUM_SEQS [256], MAX_NUM_BATCHED_TOKENS [8192],
#   SERVER_ARGS (more `tandem serve` flags), START_TIMEOUT [300], BENCH_TIMEOUT [420] (s),
#   CONFIG (an HF config.json to serve instead of SHAPE, e.g. tools/shapes/mixtral-8x7b.json; a MoE
#   one is hybrid like 30B-A3B), LAYERS (cut CONFIG to that many layers),
#   HBM_GBPS (bandwidth for the floor; default: measured here on CUDA), HEALTH_PROBE [1] (0: no
#   GET /health every 20 ms during the load), PROFILE [0] (1: the server under
#   tools/sample_stacks.py, every thread's stacks and CPU seconds into $OUT/profile.txt; the
#   server process only: SERVER_ARGS=--no-engine-process keeps the engine in it). TANDEM_COMPILE,
#   TANDEM_CUDA_GRAPHS, TANDEM_OVERLAP reach the server through the environment.
# Files in $OUT: llama-$SHAPE-dummy/config.json, server.log, bench.log, serving.json, serving.png (or .svg
# where matplotlib is missing), summary.txt. Exit 0 only if every request of every level succeeded
# and the server stopped cleanly.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--smoke" ]; then
  SHAPE=${SHAPE:-tiny} INPUT_LEN=${INPUT_LEN:-12} OUTPUT_LEN=${OUTPUT_LEN:-6}
  CONCURRENCY=${CONCURRENCY:-1,4} NUM_PROMPTS=${NUM_PROMPTS:-3,8} WARMUP=${WARMUP:-1}
  MAX_NUM_SEQS=${MAX_NUM_SEQS:-8} MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-256}
  SERVER_ARGS=${SERVER_ARGS:-"--max-model-len 256"}
fi
SHAPE=${SHAPE:-1B} INPUT_LEN=${INPUT_LEN:-256} OUTPUT_LEN=${OUTPUT_LEN:-256}
CONCURRENCY=${CONCURRENCY:-1,16,64,256} NUM_PROMPTS=${NUM_PROMPTS:-32,64,256,512}
WARMUP=${WARMUP:-32} DEVICE=${DEVICE:-auto} PORT=${PORT:-8123}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256} MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-8192}
SERVER_ARGS=${SERVER_ARGS:-} START_TIMEOUT=${START_TIMEOUT:-300} BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}
OUT=${OUT:-/tmp/tandem_serving}
PY=${PYTHON:-python3}
IS_MOE=0 MODEL_NAME="llama-$SHAPE-dummy"  # the model id clients see
case "$SHAPE" in *-A3B|*moe) IS_MOE=1 MODEL_NAME="qwen3moe-$SHAPE-dummy" ;; esac
if [ -n "${CONFIG:-}" ]; then  # any HF config.json: the model dir is named after the file
  SHAPE=$(basename "$CONFIG" .json) MODEL_NAME="$(basename "$CONFIG" .json)-dummy"
  IS_MOE=$("$PY" -c 'import json, sys; c = json.load(open(sys.argv[1]))
print(1 if c.get("num_experts") or c.get("num_local_experts") else 0)' "$CONFIG") || exit 2
fi
MODEL_DIR="$OUT/$MODEL_NAME"
case "$IS_MOE" in
  1)
    if [ "${MOE_EXPERTS:-cpu}" = gpu ]; then EXPERT_FORMAT=""  # every expert on the GPU (bf16)
    else SERVER_ARGS="--cpu-experts all --cpu-expert-format ${EXPERT_FORMAT:=int4} $SERVER_ARGS"; fi ;;
esac
mkdir -p "$MODEL_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(bash tools/ns_path.sh)${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

# The shape as an HF config.json: `tandem serve --load-format dummy` needs nothing else.
"$PY" - "$SHAPE" "$MODEL_DIR/config.json" "${CONFIG:-}" "${LAYERS:-}" <<'EOF' || exit 2
import json, sys
if sys.argv[3]:  # CONFIG: taken as it is, cut to LAYERS layers
    c = json.load(open(sys.argv[3]))
    if sys.argv[4]:
        c["num_hidden_layers"] = int(sys.argv[4])
    json.dump(c, open(sys.argv[2], "w"), indent=2)
    sys.exit(0)
rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16"}
shapes = {
    "1B": {**base, "hidden_size": 2048, "num_hidden_layers": 16, "head_dim": 64,
           "intermediate_size": 8192, "tie_word_embeddings": True, "rope_scaling": rope,
           "max_position_embeddings": 131072},
    "8B": {**base, "hidden_size": 4096, "num_hidden_layers": 32, "head_dim": 128,
           "intermediate_size": 14336, "tie_word_embeddings": False,
           "max_position_embeddings": 8192},
    "tiny": {**base, "vocab_size": 32000, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 128, "tie_word_embeddings": True, "rope_scaling": rope,
             "max_position_embeddings": 2048},
}
moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
       "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
       "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
       "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
       "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643,
       "eos_token_id": 151645, "torch_dtype": "bfloat16"}
shapes["30B-A3B"] = moe
shapes["tiny-moe"] = {**moe, "vocab_size": 32000, "hidden_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                      "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
                      "num_experts_per_tok": 2, "max_position_embeddings": 2048}
if sys.argv[1] not in shapes:
    sys.exit(f"unknown SHAPE {sys.argv[1]!r}; one of {', '.join(shapes)}")
with open(sys.argv[2], "w") as f:
    json.dump(shapes[sys.argv[1]], f, indent=2)
EOF
{
  date -u +%FT%TZ
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/device.txt"

# shellcheck disable=SC2086
PROFILER=()  # PROFILE=1: the server runs under tools/sample_stacks.py ($OUT/profile.txt)
[ "${PROFILE:-0}" != 0 ] && PROFILER=(tools/sample_stacks.py --out "$OUT/profile.txt")
SERVER_CMD=("$PY" "${PROFILER[@]}" -m tandem.app.cli serve --model "$MODEL_DIR" --load-format dummy --device "$DEVICE"
  --host 127.0.0.1 --port "$PORT"
  --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS"
  --max-queue 4096 -v $SERVER_ARGS)
say "server: ${SERVER_CMD[*]} (TANDEM_COMPILE=${TANDEM_COMPILE:-})"
"${SERVER_CMD[@]}" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
stop_server() {
  if [ -n "${SERVER_PID:-}" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVER_PID" 2>/dev/null && { echo "server did not stop in 30 s: killing it"; kill -KILL "$SERVER_PID"; }
  fi
  wait "$SERVER_PID" 2>/dev/null
  SERVER_RC=$?
  SERVER_PID=
}
trap 'stop_server' EXIT
trap 'exit 130' INT TERM

# Up when /health answers 200 (the engine is loaded, KV sized, graphs captured).
"$PY" - "$PORT" "$START_TIMEOUT" "$SERVER_PID" <<'EOF'
import os, sys, time, urllib.request
port, limit, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic()
while time.monotonic() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited during start-up (see server.log)")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                print(f"server up in {time.monotonic() - t0:.1f}s")
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(f"the server was not up after {limit:.0f}s (see server.log)")
EOF
up_rc=$?
if [ $up_rc -ne 0 ]; then
  tail -n 40 "$OUT/server.log"
  exit 1
fi
grep -E "captured|KV cache|fallback|WARNING" "$OUT/server.log" | tail -n 8

say "bench: concurrency $CONCURRENCY, $INPUT_LEN in / $OUTPUT_LEN out, requests $NUM_PROMPTS"
rm -f "$OUT/serving.json"
PROBE=--health-probe; [ "${HEALTH_PROBE:-1}" = 0 ] && PROBE=""
timeout "$BENCH_TIMEOUT" "$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$PORT" \
  --tokenizer none --dataset random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
  --sweep-concurrency "$CONCURRENCY" --sweep-num-prompts "$NUM_PROMPTS" --warmup "$WARMUP" \
  $PROBE --result-json "$OUT/serving.json" --plot "$OUT/serving.png" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
say "bench rc=$bench_rc"
grep -E "eager|fallback|recompil" "$OUT/server.log" | sort | uniq -c | head -n 5
stop_server
trap - EXIT
say "server stopped, rc=$SERVER_RC"
tail -n 2 "$OUT/server.log"

if [ -z "${CPU_GBPS:-}" ]; then
  CPU_GBPS=$("$PY" tools/peers/cpu_bandwidth.py --threads "$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))" \
    | awk '/^threads/ {print $3; exit}')
  say "CPU read bandwidth now: ${CPU_GBPS:-?} GB/s (tools/peers/cpu_bandwidth.py)"
fi
# Summary: one row per level, next to the decode floor: dense, the weight bytes read per step
# over the device's copy bandwidth; hybrid MoE, the expert bytes a step at that concurrency
# touches over the CPU read bandwidth.
"$PY" - "$OUT/serving.json" "$MODEL_DIR/config.json" "${HBM_GBPS:-}" "${EXPERT_FORMAT:-}" \
  "${CPU_GBPS:-0}" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
res_path, cfg_path, hbm, expert_fmt, cpu_gbps = sys.argv[1:6]
try:
    res = json.load(open(res_path))
except (OSError, ValueError) as e:
    sys.exit(f"no results ({e})")
from models.config import ModelConfig
from tools.bench_hybrid_moe import (dense_step_bytes, expert_bytes, gpu_step_bytes, moe_layers,
                                    touched_experts)
cfg = ModelConfig.from_hf_dict(json.load(open(cfg_path)))
moe = cfg.is_moe
read = dense_step_bytes(cfg)  # bf16; every weight but the embedding lookup (and routed experts)
if moe:
    E, k, inter, L = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, moe_layers(cfg)
    h = cfg.hidden_size
source = "HBM_GBPS"
if not hbm and not expert_fmt:
    try:
        import torch
        if torch.cuda.is_available():
            n = 1 << 30
            src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            ts = []
            for _ in range(12):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); dst.copy_(src); b.record(); b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            hbm, source = 2 * n / sorted(ts)[len(ts) // 2] / 1e9, "measured copy"
    except Exception as e:
        print(f"(no bandwidth measurement: {e})")
print(f"== summary: {res['model']}, {res['input_len']} in / {res['output_len']} out, "
      f"token-id prompts, ignore_eos, greedy ==")
floor_ms = None
step_floor_ms = lambda conc: floor_ms  # dense: every weight read once a step
if expert_fmt and not float(cpu_gbps or 0):
    print("(no CPU read bandwidth measured: no hybrid floor)")
elif expert_fmt:  # hybrid: the routed experts' bytes on the CPU dominate a decode step
    expert_ms = expert_bytes(h, inter, expert_fmt) * L / (float(cpu_gbps) * 1e9) * 1e3  # all layers
    floor_ms = k * expert_ms
    step_floor_ms = lambda conc: touched_experts(E, k, conc) * expert_ms
    print(f"{expert_fmt} experts on the CPU pool: {k * expert_ms * float(cpu_gbps) / 1e3:.2f} GB "
          f"of active experts per token; at {float(cpu_gbps):g} GB/s (CPU read) the batch-1 TPOT "
          f"floor is {floor_ms:.2f} ms ({1e3 / floor_ms:.1f} tok/s)")
elif hbm and moe:  # every expert on the GPU: the dense weights and the experts a step touches
    ms = lambda conc: gpu_step_bytes(cfg, conc) / (float(hbm) * 1e9) * 1e3
    floor_ms, step_floor_ms = ms(1), ms
    print(f"every expert on the GPU: {gpu_step_bytes(cfg, 1) / 1e9:.2f} GB read per batch-1 step; at "
          f"{float(hbm):.0f} GB/s ({source}) the batch-1 TPOT floor is {floor_ms:.2f} ms "
          f"({1e3 / floor_ms:.0f} tok/s)")
elif hbm:
    floor_ms = read / (float(hbm) * 1e9) * 1e3
    print(f"weights read per decode step {read / 1e9:.2f} GB; at {float(hbm):.0f} GB/s "
          f"({source}) the batch-1 TPOT floor is {floor_ms:.2f} ms ({1e3 / floor_ms:.0f} tok/s)")
f = lambda v: "-" if v is None else f"{v:.1f}"
print(f"{'conc':>5} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
      f"{'p99':>7} {'out tok/s':>10} {'decode tok/s':>12} {'/health p99':>11}"
      + ("  TPOT/floor" if floor_ms else ""))
for r in res["runs"]:
    hp = (r.get("health") or {}).get("p99_ms")
    tp, conc = r["tpot_ms"]["p50"], r["max_concurrency"]
    print(f"{conc:>5} {r['num_prompts']:>5} {r['failed']:>4} "
          f"{f(r['ttft_ms']['p50']):>9} {f(r['ttft_ms']['p99']):>8} {f(tp):>9} "
          f"{f(r['tpot_ms']['p99']):>7} {r['output_throughput']:>10.0f} "
          f"{f(conc * 1e3 / tp if tp else None):>12} {f(hp):>11}"
          + (f"  {tp / step_floor_ms(conc):>9.2f}x" if floor_ms and tp else ""))
    if r["errors"]:
        print(f"      errors: {r['errors']}")
print("(ms, except tok/s; decode tok/s: concurrency / TPOT p50"
      + ("; TPOT/floor: p50 TPOT over the step floor at that concurrency)" if floor_ms else ")"))
one = [r for r in res["runs"] if r["max_concurrency"] == 1 and r["ttft_ms"]["p50"]]
if one:  # one request at a time: the first token waits for the whole prompt's prefill
    print(f"prefill at concurrency 1: {res['input_len']} tokens in {one[0]['ttft_ms']['p50']:.0f} ms "
          f"(TTFT p50) = {res['input_len'] / one[0]['ttft_ms']['p50'] * 1e3:.0f} tok/s")
EOF
say "done: $OUT"
exit $(( bench_rc != 0 || SERVER_RC != 0 ))
