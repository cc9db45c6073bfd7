#!/usr/bin/env bash
# The main job.
#   GPU machine (python3 already imports torch and triton with CUDA; no registry there):
#       the evidence ladder (`wsattn ladder`), then `wsattn bench all`, run with the system
#       python3 and src/ on PYTHONPATH. Extra arguments go to `wsattn bench all`
#       (e.g. ./scripts/main.sh --quick). WSATTN_COMMIT names the commit when .git is absent.
#   Machine without a GPU: scripts/venv.sh builds .venv, then `wsattn ladder` (compile and
#       structure gates, interpreter numerics), or, while the ladder is not built, the CPU
#       smoke run of every kernel through the Triton interpreter (python -m wsattn.bench.smoke).
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

if python3 -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "main: CUDA GPU found; using $(command -v python3) with src/ on PYTHONPATH (no venv)"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
  GPU=1
else
  echo "main: no CUDA GPU visible to python3; setting up .venv"
  bash scripts/venv.sh || { echo "main: scripts/venv.sh failed" >&2; exit 1; }
  PY=.venv/bin/python
  GPU=0
fi

status=0
step() {  # step NAME COMMAND...: run it, remember a failure, keep going
  local name=$1; shift
  echo "main: == $name: $*"
  "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "main: $name exited with status $rc" >&2
    status=1
  fi
}

if "$PY" -m wsattn.cli ladder --help >/dev/null 2>&1; then
  have_ladder=1
else
  have_ladder=0
  echo "main: 'wsattn ladder' is not available in this tree yet; skipping the ladder"
fi

if [ "$GPU" = 1 ]; then
  [ "$have_ladder" = 1 ] && step ladder "$PY" -m wsattn.cli ladder
  step bench "$PY" -m wsattn.cli bench all "$@"
elif [ "$have_ladder" = 1 ]; then
  step ladder "$PY" -m wsattn.cli ladder
else
  step smoke "$PY" -m wsattn.bench.smoke
fi

echo "main: $([ "$status" = 0 ] && echo 'all steps passed' || echo 'some steps FAILED')"
exit "$status"
