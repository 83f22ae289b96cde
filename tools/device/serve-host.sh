#!/usr/bin/env bash
# `tandem serve` against the offline engine on the 1B shape (random bf16 weights), one workload:
# tools/bench_serve_vs_offline.py at CONCURRENCY [64,256], INPUT_LEN [256] in / OUTPUT_LEN [256]
# out, 2 x C prompts a level; both rates, serve/offline and the server's host time per token
# (/metrics counters). BASE=DIR (another checkout of the repository, e.g. main's) also serves
# the same workload from that tree, after this one's, as the before of a before/after.
# DEVICE [cuda]; CONFIG=FILE serves that config.json instead of the 1B shape; SERVER_ARGS: more
# `tandem serve` flags (e.g. --engine-process).
# Files in $OUT: device.txt, serve-host.json (base.json with BASE), server.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_serve_host}
source tools/device/env.sh
CONCURRENCY=${CONCURRENCY:-64,256} INPUT_LEN=${INPUT_LEN:-256} OUTPUT_LEN=${OUTPUT_LEN:-256}
MODEL_DIR="$OUT/llama-1B-dummy"
mkdir -p "$MODEL_DIR"
if [ -n "${CONFIG:-}" ]; then cp "$CONFIG" "$MODEL_DIR/config.json"; else
python3 - "$MODEL_DIR/config.json" <<'PY'
import json, sys
rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "hidden_act": "silu", "bos_token_id": 128000,
           "eos_token_id": 128001, "torch_dtype": "bfloat16", "hidden_size": 2048,
           "num_hidden_layers": 16, "head_dim": 64, "intermediate_size": 8192,
           "tie_word_embeddings": True, "rope_scaling": rope, "max_position_embeddings": 131072},
          open(sys.argv[1], "w"), indent=2)
PY
fi
ARGS=(--model "$MODEL_DIR" --device "${DEVICE:-cuda}" --concurrency "$CONCURRENCY" --input-len "$INPUT_LEN"
  --output-len "$OUTPUT_LEN" --log-dir "$OUT" "--server-args=${SERVER_ARGS:-}")
python3 tools/bench_serve_vs_offline.py "${ARGS[@]}" --json "$OUT/serve-host.json"
rc=$?
if [ -n "${BASE:-}" ]; then
  echo "== the same workload served from $BASE"
  TOOL=$PWD/tools/bench_serve_vs_offline.py
  (cd "$BASE" && PYTHONPATH="$(bash tools/ns_path.sh)" python3 "$TOOL" "${ARGS[@]}" --only serve \
    --json "$OUT/base.json") || rc=1
fi
exit $rc
