#!/usr/bin/env bash
# The two-CTA cluster decode tile (kernels/cuda/moe_gemm.cu, MoeDecodePair) in one device call:
# the kernel tests, the experts sweep and the engine's CUDA tests with the default dispatch
# (kMxfp8DecodePairOnByDefault), memcheck and racecheck on its kernel test (multicast units
# included), then decode_ab (bundle_lib.sh) with MOESERVE_DECODE_PAIR=0 (off) and 1 (on up to 32
# routes per expert). Results: tests/benchmarks/cuda/RESULTS.md, 2026-12-03 18:50. Usage:
# run_decode_pair_ab.sh BUNDLE.tgz (bin/: moe_experts_bench, cuda_kernels_test,
# cuda_experts_test, engine_cuda_test).
set -u
source "$(dirname "$0")/bundle_lib.sh"
OUT=${OUT:-/tmp/pair_out}
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 200
run_gtest cuda_experts_test 400
run_gtest engine_cuda_test 300
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  for tool in memcheck racecheck; do
    timeout 200 "$CS" --tool $tool --error-exitcode 3 \
      "$B/cuda_kernels_test" --gtest_filter='*DecodePair*' > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/$tool.log" | tr '\n' ' ')"
  done
fi
TOKENS=${TOKENS:-1,4,8,16,24,32,48,64} decode_ab MOESERVE_DECODE_PAIR "$OUT/pair.csv" 0 1
