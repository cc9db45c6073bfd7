#!/usr/bin/env bash
# Device run: bench first (clean timings), then the GPU tests and the sm_90 ladder side by side.
# Usage on the device machine: WSATTN_COMMIT=<sha> [PARTS="bench checks"] bash scripts/device_full.sh [bench args]
# Timings on 2026-11-29 (evening, one H200): bench ~100 s, GPU tests ~185 s, ladder ~27 s per
# kernel (8 kernels; it was 45-55 s before eager calls skipped the torch.library dispatcher).
# Tests and ladder run side by side, so PARTS="bench checks" may fit one 10-minute call; on a
# 2-GPU machine, running the checks on the second GPU (CUDA_VISIBLE_DEVICES) is safer. The
# ladder rewrites its JSON after each kernel, so a timeout still returns what was reached.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
PARTS=${PARTS:-"bench checks"}
BENCH_S=${BENCH_S:-300} TESTS_S=${TESTS_S:-420} LADDER_S=${LADDER_S:-540}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv;
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())"; } 2>&1 | tee "$OUT/env.log"
# at most 8 files come back from $OUT: env.log, bench.{log,json,png}, gpu_tests.log,
# ladder.log, ladder_sm90.json (and the Markdown report is rendered from it on the CPU)
if [[ " $PARTS " == *" bench "* ]]; then
  timeout "$BENCH_S" python3 -m wsattn.cli bench all --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log"
  echo "bench rc=${PIPESTATUS[0]}"
  [ -n "${PAGED_EXPERIMENT:-}" ] && timeout 90 python3 scripts/device_decode_paged.py 2>&1 | tee -a "$OUT/bench.log"
fi
if [[ " $PARTS " == *" checks "* ]]; then
  # neither is a timing we report (the ladder's profile gate is a same-run comparison,
  # disturbed equally for both sides)
  timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -m "gpu or sm90" --timeout 120 -rf \
    tests/test_prefill_gpu.py tests/test_decode_gpu.py tests/test_prefill_gluon.py > "$OUT/gpu_tests.log" 2>&1 &
  tp=$!
  timeout "$LADDER_S" python3 -m wsattn.cli ladder --target sm_90 --stress-launches ${STRESS_LAUNCHES:-2000} \
    --json "$OUT/ladder_sm90.json" > "$OUT/ladder.log" 2>&1
  echo "ladder rc=$?"
  wait $tp; echo "gpu tests rc=$?"
  tail -n 30 "$OUT/gpu_tests.log"; grep -v "ladder:" "$OUT/ladder.log" | tail -n 40
fi
