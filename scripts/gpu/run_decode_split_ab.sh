#!/usr/bin/env bash
# Not yet measured: MXFP8 decode launches that split the experts between the narrow (<= 16
# routes) and the adaptive 32-wide tile per expert (MOESERVE_DECODE_SPLIT=1; off by default)
# instead of one launch serving all experts by the largest count (the default). One device
# call: kernel tests, the experts sweep with the split on (its correctness) and off, then
# moe_experts_bench at 16-64 tokens, MXFP8, decode path, balanced / hot / random routing, both
# settings alternating, three rounds, medians (decode_ab in bundle_lib.sh). Usage: run_decode_split_ab.sh BUNDLE.tgz (bin/:
# moe_experts_bench, cuda_kernels_test, cuda_experts_test; lib/: bundle-libs.sh).
set -u
source "$(dirname "$0")/bundle_lib.sh"
OUT=/tmp/split_out
start_device_script "$1" || exit 1
# FULL=1: every kernel and experts test with the split on and off; otherwise (a shorter call)
# the MXFP8 cases of the experts sweep with the split on (off is the default, tested in CI runs
# of the GPU checks).
if [ "${FULL:-0}" = 1 ]; then
  run_gtest cuda_kernels_test 150
  MOESERVE_DECODE_SPLIT=1 run_gtest cuda_experts_test 300
  run_gtest cuda_experts_test 300
else
  MOESERVE_DECODE_SPLIT=1 run_gtest cuda_experts_test 150 --gtest_filter='*mxfp8*'
fi
TOKENS=${TOKENS:-16,32,64} ROUNDS=${ROUNDS:-3} decode_ab MOESERVE_DECODE_SPLIT "$OUT/split.csv" 0 1
