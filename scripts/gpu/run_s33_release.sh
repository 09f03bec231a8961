#!/usr/bin/env bash
# One device call for the background release thread (core/background_release.h): whether other
# threads' calls of a serving step go through while one thread waits in cudaFree /
# cudaFreeHost / cudaHostUnregister (alloc_wait_probe --concurrent_only), then the GPU tests of
# the change (background_release_cuda_test, grow_only_buffer_test, host_upload_test,
# shared_memory_cuda_test).
# Usage: run_s33_release.sh BUNDLE.tgz (bin/: moeserve, alloc_wait_probe and the test binaries).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
timeout 60 "$B/alloc_wait_probe" --concurrent_only > "$OUT/alloc_wait_concurrent.log" 2>&1
cat "$OUT/alloc_wait_concurrent.log"
run_gtest background_release_cuda_test 60
run_gtest grow_only_buffer_test 60
run_gtest host_upload_test 60
MOESERVE_BINARY=$B/moeserve run_gtest shared_memory_cuda_test 90
