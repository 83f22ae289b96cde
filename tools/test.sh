#!/usr/bin/env bash
# Installs Tandem with its test tools and runs the CPU test suite (GPU and slow tests are
# deselected by pyproject's addopts; run them with `-m gpu` / `-m slow`).
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh --dev || exit 1
python3 -m pytest -q "$@"
rc=$?
# pytest exits 5 when every test was deselected: that is not a failure of the suite.
[ "$rc" -eq 5 ] && rc=0
exit "$rc"
