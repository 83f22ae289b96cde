#!/usr/bin/env bash
# Device checks of the CPU expert pool's start-up and of its idle spin with the model on the CPU,
# in one call (instances differ, so both halves of an A/B run here, interleaved):
# - load: `load_model --load-format dummy` of a Qwen3-30B-A3B shape cut to LOAD_LAYERS layers
#   with int4 experts on the pool; the cpu_pool log line splits filling random weights from
#   converting them (serving 48 such layers took 154 s on the device, 3.2 s a layer).
# - spin: the hybrid model with everything on the CPU (tools/bench_hybrid_moe.py --device cpu)
#   at TANDEM_POOL_SPIN_US 0 and 200, alternated REPEATS times.
#   bash tools/device_check.sh pool-cpu        # about 5 minutes
# - parts (not by default): filling a layer and converting it, with and without the pool up.
# Env: STAGES ["load spin"], LOAD_LAYERS [12], REPEATS [2], BENCH_TIMEOUT [150].
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_pool_cpu}
source tools/device/env.sh
rc=0 stages=" ${STAGES:-load spin} " limit=${BENCH_TIMEOUT:-150}
if [[ $stages == *" load "* ]]; then
  timeout "$limit" python3 - "$OUT/cfg" "${LOAD_LAYERS:-12}" <<'PY' >"$OUT/load.log" 2>&1 || rc=1
import json, logging, sys, time
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from models.hf_export import to_hf_config_dict
from models.loader import load_model
from tools.bench_hybrid_moe import model_config, parse_args
out, layers = Path(sys.argv[1]), sys.argv[2]
out.mkdir(parents=True, exist_ok=True)
cfg = model_config(parse_args(["--layers", layers]))
(out / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
t = time.perf_counter()
model, _ = load_model(out, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu", load_format="dummy",
                      expert_backend="cpu_pool", config=cfg,
                      expert_options={"fmt": "int4", "cpu_experts": "all"})
print(f"load_model: {layers} layers in {time.perf_counter() - t:.1f}s")
model.expert_backend.close()
PY
  grep -E "cpu_pool: [0-9]+ MoE|load_model" "$OUT/load.log" || tail -n 5 "$OUT/load.log"
fi
if [[ $stages == *" parts "* ]]; then  # where a dummy layer's load time goes, step by step
  timeout "$limit" python3 - <<'PY' >"$OUT/parts.log" 2>&1 || rc=1
import time
import torch
from ext.cpu.pool import CpuExpertPool
from models.loader.dummy import _fill_normal
from concurrent.futures import ThreadPoolExecutor
E, H, I = 128, 2048, 768
w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
w2 = torch.empty(E, H, I, dtype=torch.bfloat16)
def fill(seed):
    t = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        _fill_normal(w13, 0.02, seed, ex)
        _fill_normal(w2, 0.02, seed + 1, ex)
    return time.perf_counter() - t
def timed(f):
    t = time.perf_counter(); f(); return time.perf_counter() - t
print(f"fill, no pool: {fill(1):.2f}s, again {fill(2):.2f}s")
if torch.cuda.is_available():
    torch.cuda.init(); torch.empty(1, device="cuda")
for spin in (2000, 0):
    with CpuExpertPool(num_threads=14, spin_us=spin) as pool:
        print(f"spin {spin}: convert int4 {timed(lambda: pool.add_layer(0, w13, w2, 'int4')):.2f}s, "
              f"again {timed(lambda: pool.add_layer(1, w13, w2, 'int4')):.2f}s; "
              f"fill with the pool up {fill(3):.2f}s; convert after it "
              f"{timed(lambda: pool.add_layer(2, w13, w2, 'int4')):.2f}s")
print(f"fill, pool closed: {fill(4):.2f}s")
PY
  cat "$OUT/parts.log" | tail -n 6
fi
if [[ $stages == *" spin "* ]]; then
  for i in $(seq "${REPEATS:-2}"); do
    for spin in 0 200; do
      CUDA_VISIBLE_DEVICES= timeout "$limit" python3 tools/bench_hybrid_moe.py --device cpu \
        --formats int4 --layers 8 --vocab 32000 --attention-backend torch --spin-us "$spin" \
        --decode-steps 16 --batch 4 --prefill 256 --graphs off --gpu-prefill off \
        >"$OUT/spin_${spin}_$i.log" 2>&1 || rc=1
      echo "spin $spin us, run $i: $(grep -E '^\| hybrid_int4' "$OUT/spin_${spin}_$i.log" | head -1)"
    done
  done
fi
exit $rc
