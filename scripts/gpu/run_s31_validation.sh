#!/usr/bin/env bash
# One device call validating a build (main plus the early-weights commits) on one GPU: the CUDA
# suites that run_early_weights_ab.sh does not run (host uploads, CUDA shared-memory regions with
# the bundle's server, the graphed engine, the registry's CUDA combinations), then that script
# (the kernel tests, the experts sweep, racecheck on the PDL chain tests) from its second round
# (settings in reversed order).
# Usage: run_s31_validation.sh BUNDLE.tgz (bin/: the test binaries, moeserve_b,
# engine_forward_bench, moe_experts_bench). Writes under $OUT.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
run_gtest host_upload_test 60
MOESERVE_BINARY=$B/moeserve_b run_gtest shared_memory_cuda_test 90
run_gtest engine_cuda_test 200
run_gtest engine_mk_combinations_test 200 --gtest_filter='*Cuda*:*cuda*'
SA_READY=1 FIRST_ROUND=2 ROUNDS=2 bash scripts/gpu/run_early_weights_ab.sh "$1"
