#!/usr/bin/env bash
# Session 37's last device call: the GPU suites of main's build (bundle of make_ab_bundle.sh,
# build b): cuda_kernels_test, a shard of cuda_experts_test (EXPERTS_SHARDS, default 8),
# engine_cuda_test, memcheck on the split-K tests, host_upload_test and shared_memory_cuda_test
# (which starts the bundle's moeserve: graphs are now warmed before it serves).
# Usage: run_s37_final.sh BUNDLE.tgz
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
t0=$(date +%s)
EXPERTS_SHARDS=${EXPERTS_SHARDS:-8} SANITIZERS=memcheck gpu_suites '*SplitK*'
run_gtest host_upload_test 120
MOESERVE_BINARY=$B/moeserve_b run_gtest shared_memory_cuda_test 300
echo "total $(( $(date +%s) - t0 )) s"
