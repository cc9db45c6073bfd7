#!/usr/bin/env bash
# One device call: bench first (clean timings), then the GPU tests and the sm_90 ladder.
# Usage on the device machine: WSATTN_COMMIT=<sha> bash scripts/device_full.sh [bench args]
# Writes everything under $OUT (or ./device-out) as it goes, so a timeout still returns logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
BENCH_S=${BENCH_S:-240} TESTS_S=${TESTS_S:-200} LADDER_S=${LADDER_S:-200}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())"; } 2>&1 | tee "$OUT/bench.log"
# at most 8 files come back from $OUT: bench.{log,json,png}, gpu_tests.log, ladder.log,
# ladder_sm90.{json,md} and the ladder's chart
timeout "$BENCH_S" python3 -m wsattn.cli bench all --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" 2>&1 | tee -a "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}"
[ -n "${PAGED_EXPERIMENT:-}" ] && timeout 90 python3 scripts/device_decode_paged.py 2>&1 | tee -a "$OUT/bench.log"
# tests and ladder side by side: neither is a timing we report (the ladder's profile gate is
# a same-run comparison, disturbed equally for both sides).
timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -m "gpu or sm90" --timeout 120 \
  tests/test_prefill_gpu.py tests/test_decode_gpu.py tests/test_prefill_gluon.py > "$OUT/gpu_tests.log" 2>&1 &
tp=$!
timeout "$LADDER_S" python3 -m wsattn.cli ladder --target sm_90 --stress-launches ${STRESS_LAUNCHES:-2000} \
  --json "$OUT/ladder_sm90.json" --markdown "$OUT/ladder_sm90.md" > "$OUT/ladder.log" 2>&1
echo "ladder rc=$?"
wait $tp; echo "gpu tests rc=$?"
tail -n 30 "$OUT/gpu_tests.log"; tail -n 40 "$OUT/ladder.log"
