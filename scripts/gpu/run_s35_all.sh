#!/usr/bin/env bash
# Session 35's one device call: run_s35_check.sh (GPU tests, the one-token call by variant), then,
# while the call has time left (SERVING_BY_S, default 300 s in), run_s35_serving_ab.sh.
# Usage: run_s35_all.sh BUNDLE.tgz
set -u
cd "$(dirname "$0")/../.."
t0=$(date +%s)
EXPERTS_SHARDS=${EXPERTS_SHARDS:-4} ROUNDS=${ROUNDS:-2} VARIANTS=${VARIANTS:-"bh bwh bswh bnh"} \
  bash scripts/gpu/run_s35_check.sh "$1"
if (( $(date +%s) - t0 < ${SERVING_BY_S:-300} )); then
  SA_READY=1 bash scripts/gpu/run_s35_serving_ab.sh "$1"
else
  echo "serving A/B skipped: $(( $(date +%s) - t0 )) s used"
fi
echo "total $(( $(date +%s) - t0 )) s"
