#!/usr/bin/env bash
# Multi-GPU run of wsattn.sp on the device machine (nvidia-h200-x2 or larger):
# the NCCL equality tests, then the SP benchmark under torchrun, one process per GPU.
# Usage: WSATTN_COMMIT=<sha> [PARTS="tests bench"] bash scripts/device_sp.sh [sp bench args]
#   e.g. PARTS=bench bash scripts/device_sp.sh --quick
# Everything lands under $OUT (or ./device-out); the bench rewrites its JSON after each shape.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
# NVLink multicast must stay off on the lent machines (KINDS.md): a program using it can take
# the host's GPUs out of service. Set here too, so every child inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PARTS=${PARTS:-"tests bench"}
TESTS_S=${TESTS_S:-300} BENCH_S=${BENCH_S:-540}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version(), torch.cuda.nccl.version())"
  env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' ; echo "gpus=$NGPU"; } 2>&1 | tee "$OUT/sp_env.log"
if [[ " $PARTS " == *" tests "* ]]; then
  timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -m multi_gpu --timeout "$TESTS_S" -rf \
    tests/test_sp_nccl.py > "$OUT/sp_tests.log" 2>&1
  echo "sp tests rc=$?"; tail -n 40 "$OUT/sp_tests.log"
fi
if [[ " $PARTS " == *" bench "* ]]; then
  timeout "$BENCH_S" python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    -m wsattn.sp.bench --json "$OUT/sp_bench.json" "$@" > "$OUT/sp_bench.log" 2>&1
  echo "sp bench rc=$?"; tail -n 40 "$OUT/sp_bench.log"
fi
