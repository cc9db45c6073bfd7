#!/usr/bin/env bash
# Nsight Compute profile of one prefill launch per implementation (device helper, not CI).
# Usage on the device machine: bash scripts/device_ncu.sh [impls] [target args]
#   e.g. bash scripts/device_ncu.sh "gluon cudnn" --n 4096 --d 128
# KINDS.md: ncu reads the counters on the Firecracker machines with --clock-control none
# (the x2/x4 kinds); the clocks are then whatever the GPU runs at, as in the benchmarks.
# Writes to $OUT, per implementation: ncu_<tag>.txt (every section of --set full, as text)
# and, with SOURCE=1, ncu_<tag>_sass.csv.gz (per-SASS-instruction counters: stall reasons,
# executed instructions). The .ncu-rep reports stay in $REP (not returned).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}; REP=${REP:-/tmp/ncu-rep}; mkdir -p "$OUT" "$REP"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
IMPLS=${1:-"gluon cudnn"}; shift || true
for impl in $IMPLS; do
  tag=$(echo "$impl $*" | tr -c 'a-zA-Z0-9\n' '_' | tr -s '_' | sed 's/_$//')
  timeout 300 ncu --clock-control none --nvtx --nvtx-include "prof/" --set full \
    --import-source no -f -o "$REP/$tag" python3 scripts/device_ncu_target.py "$impl" "$@" \
    > "$OUT/ncu_$tag.txt" 2>&1
  echo "ncu $impl rc=$?"
  ncu -i "$REP/$tag.ncu-rep" --page details --print-units base >> "$OUT/ncu_$tag.txt" 2>&1
  if [ -n "${SOURCE:-}" ]; then
    ncu -i "$REP/$tag.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_${tag}_sass.csv.gz"
  fi
done
