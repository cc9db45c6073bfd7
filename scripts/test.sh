#!/usr/bin/env bash
# The test command: CPU tests (kernels through the Triton interpreter, compile-only checks
# for sm_90/sm_100/sm_120, gloo multi-process tests). GPU tests skip with a reason here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/python -m pytest -q -n "${WSATTN_TEST_WORKERS:-2}" "$@"
