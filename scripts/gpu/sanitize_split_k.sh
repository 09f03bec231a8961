#!/usr/bin/env bash
# compute-sanitizer on split-K (one device call): memcheck, racecheck and synccheck on
# CudaKernelsTest.GroupedGemmSplitKMatchesUnsplit, memcheck on the experts cases that split
# (trivial layer at 1 and 16 tokens, W2 K of 1000, batched). Usage: sanitize_split_k.sh
# BUNDLE.tgz (sa/{bin,lib} with cuda_kernels_test and cuda_experts_test). Writes $OUT/sanitizer.txt.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/bundle_lib.sh"
unpack_bundle "$1" || exit 1
S=$OUT/sanitizer.txt
{
  for tool in memcheck racecheck synccheck; do
    echo "== $tool GroupedGemmSplitKMatchesUnsplit"
    timeout 100 compute-sanitizer --tool $tool "$B/cuda_kernels_test" \
      --gtest_filter='*SplitK*' 2>&1 | grep -E "SUMMARY|hazard|PASSED|FAILED|rror" | head -8
  done
  echo "== memcheck cuda_experts_test, the split cases"
  timeout 150 compute-sanitizer --tool memcheck "$B/cuda_experts_test" \
    --gtest_filter='*H7168_I64*:*H520_I1000*:*H1000_I72*' 2>&1 |
    grep -E "ERROR SUMMARY|PASSED|FAILED" | head -8
} > "$S" 2>&1
cat "$S"
