#!/usr/bin/env bash
# Create .venv (once) with what wsattn needs on a CPU machine: torch 2.13.0 (CPU build, on
# this kind of machine's disk), triton 3.6, and the package itself in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import wsattn, torch, triton, pytest, xdist, pytest_timeout, transformers, safetensors" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  # numpy < 2.4: Triton 3.6's interpreter breaks on loops with a run-time bound under
  # numpy 2.4 (triton-lang/triton#9171, fixed after 3.6.0).
  .venv/bin/pip install -q "torch==2.13.0" "triton==3.6.*" "numpy<2.4"
  .venv/bin/pip install -q -e ".[test,plot]"
fi
