#!/usr/bin/env bash
# The MXFP8 32-token decode tile (17-32 routes per expert) with warpgroup MMAs against mma.sync.
# One device call: the kernel tests (the decode-wgmma test under memcheck and racecheck too), the
# experts sweep's MXFP8 cases with MOESERVE_DECODE_MMA=wgmma (FULL=1: also the whole sweep in four
# shards with the default dispatch, and engine_cuda_test), then decode_ab (bundle_lib.sh) over
# SETTINGS (MOESERVE_DECODE_MMA=sync|wgmma, or "default": unset). Usage:
# run_decode_wgmma_ab.sh BUNDLE.tgz (bin/: moe_experts_bench, cuda_kernels_test,
# cuda_experts_test, engine_cuda_test; lib/: bundle-libs.sh). Results: tests/benchmarks/cuda/
# RESULTS.md, 2026-12-03 16:20.
set -u
source "$(dirname "$0")/bundle_lib.sh"
OUT=${OUT:-/tmp/wg_out}
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 200
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  for tool in memcheck racecheck; do
    timeout 200 "$CS" --tool $tool --error-exitcode 3 "$B/cuda_kernels_test" \
      --gtest_filter='*DecodeWgmma*' > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/$tool.log" | tr '\n' ' ')"
  done
fi
MOESERVE_DECODE_MMA=wgmma run_gtest cuda_experts_test 300 --gtest_filter='*mxfp8*:*Mxfp8*'
if [ "${FULL:-0}" = 1 ]; then
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 250 "$B/cuda_experts_test" \
      > "$OUT/experts_$i.log" 2>&1 &
  done
  wait
  for i in 0 1 2 3; do
    echo "experts shard $i: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/experts_$i.log" | tr '\n' ' ')"
  done
  grep -h -E '^\[  FAILED|Failure' -A4 "$OUT"/experts_*.log | head -20
  run_gtest engine_cuda_test 250
fi
# shellcheck disable=SC2086  # SETTINGS is a list
TOKENS=${TOKENS:-1,16,32,64,128} decode_ab MOESERVE_DECODE_MMA "$OUT/wg.csv" ${SETTINGS:-sync wgmma}
