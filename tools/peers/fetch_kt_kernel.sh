#!/usr/bin/env bash
# Fetches KTransformers' own CPU MoE kernels (PyPI kt-kernel, a pybind11 extension) for the GPU
# machine's Python 3.12, keeping only what a layer benchmark imports (about 17 MB of the 100 MB
# wheel: the package's Python entry points, its AMX and AVX-512 extensions and their shared
# libraries), into DIR [.peers/kt]. Run here (the GPU machine has no registry), keep DIR
# git-ignored, carry it to the GPU machine and pass it to `tools/bench_cpu_moe.py --peer-kt DIR`.
# The peer's own needs there: torch (present) and the gguf wheel (device-wheels.sh fetches it).
set -euo pipefail
DIR=${1:-.peers/kt}
VERSION=${KT_KERNEL_VERSION:-0.7.2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=""
for n in 17 27 28 31 34 35; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $plat -d "$tmp" "kt-kernel==$VERSION" 2>&1 | grep -v "^WARNING" || true
whl=$(ls "$tmp"/kt_kernel-*.whl)
rm -rf "$DIR" && mkdir -p "$DIR"
python3 - "$whl" "$DIR" <<'PY'
import sys, zipfile
whl, out = sys.argv[1:3]
keep = ("kt_kernel/__init__.py", "kt_kernel/_cpu_detect.py", "kt_kernel/experts.py",
        "kt_kernel/experts_base.py", "kt_kernel/utils/", "kt_kernel.libs/",
        "kt_kernel/_kt_kernel_ext_amx", "kt_kernel/_kt_kernel_ext_avx512_base")
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.startswith(keep)]
    z.extractall(out, names)
print(f"kt-kernel: {len(names)} files into {out}")
PY
du -sh "$DIR"
