#!/usr/bin/env bash
# The grouped GEMMs' tile choice by the average expert's padding (MoeGroupedSm90UsesSmallTiles)
# against the build before (64-row tiles only up to 64 rows per expert), with PyTorch's peers.
set -u
source scripts/gpu/bundle_lib.sh
FINAL_OUT=${OUT:-/tmp/out}
OUT=/tmp/tile2_out
start_device_script "$1" || exit 1
mkdir -p "$OUT/py"
timeout 100 "$B/cuda_kernels_test" > "$OUT/kt.log" 2>&1
echo "cuda_kernels_test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kt.log" | tr '\n' ' ')"
timeout 300 "$B/cuda_experts_test" > "$OUT/et.log" 2>&1
echo "cuda_experts_test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/et.log" | tr '\n' ' ')"
MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_TOKENS=512,520,600,640,768,1024,1280 timeout 400 \
  python3 scripts/gpu/bench_moe.py "$B/moe_experts_bench" "$OUT/py" "$B/moe_experts_bench_before" > "$OUT/py.log" 2>&1
echo "bench_moe rc=$?"
grep -E '^\| (seed|dsv3) ' "$OUT/py.log"
cp "$OUT/py.log" "$FINAL_OUT/" 2>/dev/null; cp "$OUT/py/results.md" "$FINAL_OUT/" 2>/dev/null; true
