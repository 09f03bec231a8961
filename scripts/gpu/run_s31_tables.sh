#!/usr/bin/env bash
# Issue 13's and issue 12's tables in one device call, on the bundle of run_s31_validation.sh:
# bench_moe.py (the expert MLPs of both layers and formats, every token count and path, PyTorch
# peers and the device's ceilings measured in the same run; at most BENCH_S seconds, default 300)
# then the serving benchmark (tests/benchmarks/serving/run_serving_bench.sh, WFS default mxfp8).
# Usage: run_s31_tables.sh BUNDLE.tgz. Writes under $OUT (moe/results.md, serving/).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
mkdir -p "$OUT/moe"
timeout "${BENCH_S:-300}" python3 scripts/gpu/bench_moe.py "$B/moe_experts_bench" "$OUT/moe" \
  > "$OUT/bench_moe.log" 2>&1
echo "bench_moe rc=$?"
[ -e "$B/moeserve" ] || ln -s moeserve_b "$B/moeserve"
WFS=${WFS:-mxfp8} OUT=$OUT/serving bash tests/benchmarks/serving/run_serving_bench.sh "$B" 2>&1 |
  sed -n '/== summary ==/,$p' | cut -c1-400
# The expert table, compact: layer fmt tokens routing path us %floor x PyTorch.
grep -E '^device:' "$OUT/moe/results.md"
awk -F'|' '/^\| (seed|dsv3) / { gsub(/ /, "", $0); print $2, $3, $4, $5, $6, $8, $11, $14 }' \
  "$OUT/moe/results.md"
grep -E '^crossover' "$OUT/moe/results.md" | cut -c1-120
