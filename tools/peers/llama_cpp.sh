#!/usr/bin/env bash
# llama.cpp as the end-to-end peer: built with CUDA on the GPU machine from the tree that the
# llama-cpp-python sdist (PyPI) vendors, run on random-weight GGUFs of real shapes
# (tools/peers/gen_gguf.py) with llama-bench, next to Tandem's own benchmarks in the same call.
#
#   bash tools/peers/llama_cpp.sh fetch            # HERE: the pruned tree into .peers/llama.cpp (git-ignored, ~31 MB)
#   bash tools/peers/llama_cpp.sh build            # GPU machine: .peers/llama.cpp/build/bin/$TARGETS (~5 min)
#   bash tools/peers/llama_cpp.sh build-cpu        # CPU VM: llama-bench only, no CUDA, into $CPU_BUILD (20-40 min at -j2)
#   bash tools/peers/llama_cpp.sh gguf [FILE...]   # GPU machine: $GGUF_DIR/FILE.gguf [moe-q4_0 dense-bf16] (~20 GB, ~15 s)
#   bash tools/peers/llama_cpp.sh bench [NAME...]  # GPU machine: llama-bench workloads into $OUT/llama_<NAME>.md
#
# Files (tools/peers/gen_gguf.py): moe-q4_0 (Qwen3-30B-A3B shape, Q4_0 experts), dense-bf16,
# dense-q4_0, dense-q4_k (Llama-3-8B shape, every matrix in that type).
# Workloads (the commands behind the peer figures in docs/BENCHMARKS.md):
#   moe-hybrid-decode  Qwen3-30B-A3B shape, Q4_0 experts on the CPU (-ot exps=CPU), tg128
#   moe-hybrid-prefill the same, pp2048 at micro-batch 512 and 2048
#   moe-gpu            every weight on the GPU: pp2048 + tg128
#   dense-gpu          Llama-3-8B shape, bf16: pp2048 + tg128
#   dense-q4_0-gpu, dense-q4_k-gpu  the same shape in Q4_0 / Q4_K: pp2048 + tg128
# Env: LLAMA_CPP_PY_VERSION [0.3.36], GGUF_DIR [/root/gguf, else /dev/shm/gguf], THREADS [14,16],
# REPS [3], OUT [./peer-out], CUDA_ARCH [90], TARGETS ["llama-bench llama-server"],
# CPU_BUILD [/work/peer-build/llama.cpp-cpu, outside the repo], CPU_CFLAGS [AMX off], JOBS [nproc],
# LLAMA_CMAKE_ARGS [none; e.g. -DGGML_CUDA_FA=OFF: a shorter CUDA build without FlashAttention].
set -uo pipefail
cd "$(dirname "$0")/../.."
TREE=.peers/llama.cpp
OUT=${OUT:-peer-out}
mkdir -p "$OUT"
say() { echo "[llama_cpp $(date -u +%T)] $*" | tee -a "$OUT/llama_cpp.log"; }

fetch() {
  local version=${LLAMA_CPP_PY_VERSION:-0.3.36} tmp
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$version" \
    2>&1 | grep -v "^WARNING"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$TREE" && mkdir -p "$(dirname "$TREE")"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$TREE"
  rm -rf "$tmp"
  # what neither build nor llama-bench/llama-server needs: models, docs, examples, tests, the
  # web UI's sources and the GPU backends other than CUDA
  (cd "$TREE" && rm -rf models docs examples tests media benches conversion .github .devops \
    tools/ui/src tools/ui/tests tools/ui/package-lock.json tools/server/webui \
    ggml/src/ggml-{vulkan,sycl,metal,opencl,musa,cann,kompute,hip,webgpu,zdnn,rpc,hexagon,et,openvino,virtgpu})
  du -sh "$TREE"
}

build() {
  [ -d "$TREE" ] || { say "no $TREE: run 'fetch' on the development machine and carry it"; exit 2; }
  local t=$SECONDS
  cmake -S "$TREE" -B "$TREE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_NATIVE=ON ${LLAMA_CMAKE_ARGS:-} > "$OUT/llama_configure.log" 2>&1 \
    && cmake --build "$TREE/build" --target ${TARGETS:-llama-bench llama-server} -j"$(nproc)" \
      > "$OUT/llama_build.log" 2>&1
  local rc=$?
  say "build rc=$rc in $((SECONDS - t)) s"
  return $rc
}

build_cpu() {
  [ -d "$TREE" ] || { say "no $TREE: run 'fetch' first"; exit 2; }
  local dir=${CPU_BUILD:-/work/peer-build/llama.cpp-cpu} t=$SECONDS
  # the CPU VM's CPUID lists AMX, but a native build's prefill died with SIGILL at tileloadd in
  # ggml's AMX matmul there. Explicit -mno-* win over -march=native in GCC.
  local CPU_CFLAGS=${CPU_CFLAGS--mno-amx-tile -mno-amx-int8 -mno-amx-bf16}
  mkdir -p "$dir"
  cmake -S "$TREE" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$CPU_CFLAGS" -DCMAKE_CXX_FLAGS="$CPU_CFLAGS" \
    > "$OUT/llama_cpu_configure.log" 2>&1 \
    && cmake --build "$dir" --target llama-bench -j"${JOBS:-$(nproc)}" > "$OUT/llama_cpu_build.log" 2>&1
  local rc=$?
  say "cpu build rc=$rc in $((SECONDS - t)) s: $dir/bin/llama-bench"
  return $rc
}

gguf_dir() {
  local avail
  avail=$(df -BG --output=avail / | tail -1 | tr -dc 0-9)
  if [ -n "${GGUF_DIR:-}" ]; then echo "$GGUF_DIR"; elif [ "${avail:-0}" -ge 42 ]; then echo /root/gguf; else echo /dev/shm/gguf; fi
}

gguf() {
  local dir t=$SECONDS name args
  dir=$(gguf_dir)
  mkdir -p "$dir"
  [ $# -gt 0 ] || set -- moe-q4_0 dense-bf16
  for name in "$@"; do
    case $name in
      moe-q4_0) args=(moe --experts-type q4_0) ;;
      dense-bf16) args=(dense) ;;
      dense-q4_0) args=(dense --dense-type q4_0) ;;
      dense-q4_k) args=(dense --dense-type q4_k) ;;
      *) say "unknown file $name"; return 2 ;;
    esac
    [ -f "$dir/$name.gguf" ] || python3 tools/peers/gen_gguf.py "${args[@]}" "$dir/$name.gguf" \
      || return 1
  done
  say "ggufs $* in $dir in $((SECONDS - t)) s"
}

bench() {
  local lb="$TREE/build/bin/llama-bench" dir reps=${REPS:-3} threads=${THREADS:-14,16}
  dir=$(gguf_dir)
  [ -x "$lb" ] || { say "no $lb: run 'build' first"; exit 2; }
  local moe="$dir/moe-q4_0.gguf" dense="$dir/dense-bf16.gguf"
  [ $# -gt 0 ] || set -- moe-hybrid-decode moe-hybrid-prefill moe-gpu dense-gpu
  for name in "$@"; do
    local args
    case $name in
      moe-hybrid-decode) args=(-m "$moe" -ngl 99 -ot exps=CPU -fa on -t "$threads" -p 0 -n 128) ;;
      moe-hybrid-prefill) args=(-m "$moe" -ngl 99 -ot exps=CPU -fa on -t "$threads" -p 2048 -n 0 -ub 512,2048) ;;
      moe-gpu) args=(-m "$moe" -ngl 99 -fa on -p 2048 -n 128 -ub 512,2048) ;;
      dense-gpu) args=(-m "$dense" -ngl 99 -fa on -p 2048 -n 128 -ub 512,2048) ;;
      dense-q4_0-gpu | dense-q4_k-gpu)
        args=(-m "$dir/${name%-gpu}.gguf" -ngl 99 -fa on -p 2048 -n 128 -ub 512,2048) ;;
      *) say "unknown workload $name"; exit 2 ;;
    esac
    local t=$SECONDS
    timeout 600 "$lb" -o md -r "$reps" "${args[@]}" > "$OUT/llama_$name.md" 2> "$OUT/llama_$name.err"
    say "$name rc=$? in $((SECONDS - t)) s: llama-bench ${args[*]}"
    grep -E '^\| (qwen|llama)' "$OUT/llama_$name.md" | tee -a "$OUT/llama_cpp.log"
  done
}

stage=${1:-}
shift || true
case $stage in
  fetch | build | gguf | bench) "$stage" "$@" ;;
  build-cpu) build_cpu "$@" ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac
