# Sourced by the device stages (tools/device/*.sh, run through tools/device_check.sh) after
# they set OUT: makes $OUT, puts the repository on PYTHONPATH, installs the wheels the device
# lacks from .device-wheels/ (no package registry there; ../shared/tools/device-wheels.sh fills
# it), records the machine in $OUT/device.txt and defines run_tests (below).
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(bash tools/ns_path.sh)${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .device-wheels ]; then
  python3 -m pip install -q --no-index --no-deps .device-wheels/*.whl 2>&1 | grep -v WARNING
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null; lscpu | grep -E 'Model name|L3'; } | tee "$OUT/device.txt"

# run_tests NAME LIMIT PYTEST_ARGS...: pytest within LIMIT seconds into $OUT/NAME.log (the
# project's addopts replaced, so the caller's -m selects); prints the rc, the time and the
# summary lines; returns pytest's rc.
run_tests() {
  local name=$1 limit=$2 t0 t_rc
  shift 2
  t0=$(date +%s)
  timeout "$limit" python3 -m pytest -q "$@" -p no:cacheprovider \
    -o addopts="-ra --import-mode=importlib" -W ignore::DeprecationWarning >"$OUT/$name.log" 2>&1
  t_rc=$?
  echo "$name rc=$t_rc in $(( $(date +%s) - t0 ))s"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -n 15
  return "$t_rc"
}
