#!/usr/bin/env bash
# Installs Tandem into the current Python environment.
#   bash tools/install.sh          # runtime only
#   bash tools/install.sh --dev    # plus test and benchmark tools
# Torch (tools/torch_choice.py decides and says which): an installed torch is kept; otherwise
# the CUDA build where an NVIDIA driver is present, the CPU build everywhere else
# (TANDEM_TORCH=cpu|cuda overrides the driver check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
"$PY" tools/torch_choice.py --install --python "$PY"
"$PY" -m pip install -q -e ".${extra}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$PY" -c "import tandem.app, tandem.runtime, tandem.models, tandem.ext" || { echo "[tandem] install failed" >&2; exit 1; }
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "[tandem] installed; torch $("$PY" -c 'import torch; print(torch.__version__)')" >&2
