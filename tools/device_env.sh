# Sourced by the device scripts (tools/hybrid_check.sh, pack_check.sh, hybrid_serving.sh) after
# they set OUT: makes $OUT, puts the repository on PYTHONPATH, installs the wheels the device
# lacks from .device-wheels/ (no package registry there; ../shared/tools/device-wheels.sh fills
# it) and records the machine in $OUT/device.txt.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .device-wheels ]; then
  python3 -m pip install -q --no-index --no-deps .device-wheels/*.whl 2>&1 | grep -v WARNING
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null; lscpu | grep -E 'Model name|L3'; } | tee "$OUT/device.txt"
