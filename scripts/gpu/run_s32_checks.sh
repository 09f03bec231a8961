#!/usr/bin/env bash
# One device call for GrowOnlyBuffer's growths that no longer wait for the device: which CUDA
# allocation calls wait for a held stream (scripts/gpu/alloc_wait_probe.cu), then the CUDA
# suites on the bundle's build (grow_only_buffer_test first).
# Usage: run_s32_checks.sh BUNDLE.tgz (bin/: moeserve, alloc_wait_probe and the test binaries).
# Writes under $OUT.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
timeout 90 "$B/alloc_wait_probe" > "$OUT/alloc_wait_probe.log" 2>&1
cat "$OUT/alloc_wait_probe.log"
run_gtest grow_only_buffer_test 120
run_gtest host_upload_test 60
MOESERVE_BINARY=$B/moeserve run_gtest shared_memory_cuda_test 90
run_gtest engine_mk_combinations_test 200 --gtest_filter='*Cuda*:*cuda*'
run_gtest cuda_kernels_test 200
run_gtest cuda_experts_test 400
run_gtest engine_cuda_test 300
