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
SANITIZERS='memcheck racecheck' gpu_suites '*DecodePair*'
TOKENS=${TOKENS:-1,4,8,16,24,32,48,64} decode_ab MOESERVE_DECODE_PAIR "$OUT/pair.csv" 0 1
