#!/usr/bin/env bash
# A/B of a CPU-pool change on one machine, in one call: the same command in this tree (B, the
# change) and in a copy of it with some files swapped back (A), alternated ROUNDS times. Each
# tree builds its own ext/cpu (the build cache is keyed by the sources' hash).
#   AB_FILES=".device-wheels/old_kernels_amx_int8.cpp:ext/cpu/kernels_amx_int8.cpp" \
#     bash tools/device/pool-ab.sh python3 tools/bench_cpu_moe.py --tokens 64 256 --formats int8 int4
# Env: AB_FILES (required: "saved:path" pairs, the A side's file for each path), ROUNDS [1],
#   OUT [/tmp/tandem_pool_ab]: a.N.log / b.N.log per round.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tandem_pool_ab}
mkdir -p "$OUT"
[[ -n ${AB_FILES:-} && $# -gt 0 ]] || { echo "usage: AB_FILES='saved:path ...' $0 command..." >&2; exit 2; }
A=$(mktemp -d /tmp/tandem_ab.XXXXXX)
cp -a . "$A/"
for pair in $AB_FILES; do
  src=${pair%%:*} dst=${pair#*:}
  [[ -f $src && -f $dst ]] || { echo "AB_FILES: $pair: no such file" >&2; exit 2; }
  cp "$src" "$A/$dst"
done
rc=0
for round in $(seq "${ROUNDS:-1}"); do
  for side in a b; do
    dir=$PWD; [[ $side == a ]] && dir=$A
    echo "== round $round, side $side ($([[ $side == a ]] && echo "AB_FILES swapped in" || echo "this tree"))"
    (cd "$dir" && "$@") >"$OUT/$side.$round.log" 2>&1 || rc=1
    grep -vE "converted" "$OUT/$side.$round.log" | tail -n 20
  done
done
rm -rf "$A"
exit $rc
