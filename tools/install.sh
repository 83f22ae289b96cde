#!/usr/bin/env bash
# Installs Tandem into the current Python environment.
#   bash tools/install.sh          # runtime only
#   bash tools/install.sh --dev    # plus test and benchmark tools
# Torch: a machine that already has torch (a GPU machine with its CUDA build) keeps it;
# a machine without one gets the CPU build torch==2.13.0 (on these machines a local file,
# elsewhere the CPU wheel index), never the multi-GB CUDA build by accident.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[tandem] no torch found: installing the CPU build torch==2.13.0" >&2
  "$PY" -m pip install -q torch==2.13.0 \
    || "$PY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install -q -e ".${extra}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$PY" -c "import app, runtime, models, ext" || { echo "[tandem] install failed" >&2; exit 1; }
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "[tandem] installed; torch $("$PY" -c 'import torch; print(torch.__version__)')" >&2
