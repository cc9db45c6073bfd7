#!/usr/bin/env bash
# Write an earlier commit's src/ into ab_base/ (ignored by git) for scripts/device.sh's
# BENCH_BASE: the "before" side of an A/B measured in the same device call.
#
#   scripts/ab_base.sh REV     then a device call with carry ["ab_base"] and
#                              BENCH_BASE=ab_base BENCH_ARGS="..." bash scripts/device.sh bench
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/ab_base.sh REV" >&2; exit 2; }
rev=$(git rev-parse --short "$1^{commit}")
rm -rf ab_base && mkdir ab_base
git archive "$rev" src | tar -x -C ab_base
echo "$rev" > ab_base/COMMIT
echo "ab_base/: src/ of $rev"
