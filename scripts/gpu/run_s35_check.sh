#!/usr/bin/env bash
# One device call (session 35): the GPU tests that landed without a GPU (nccl_host_transfer_test,
# grow_only_buffer_test, background_release_cuda_test; cuda_experts_test and engine_cuda_test run
# inside run_small_call_ab.sh's suites), alloc_wait_probe's concurrent part, then
# run_small_call_ab.sh on the server's one-token call (issue 12: an untimed call's server total,
# VARIANTS default "b bh bwh bswh bnh"). Bundle: make_ab_bundle.sh HEAD HEAD with the extra test
# binaries and alloc_wait_probe in bin/. Usage: run_s35_check.sh BUNDLE.tgz
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
for t in nccl_host_transfer_test grow_only_buffer_test background_release_cuda_test; do
  [ -x "$B/$t" ] && run_gtest $t 200
done
timeout 120 "$B/alloc_wait_probe" --concurrent_only > "$OUT/alloc_wait_probe.log" 2>&1
echo "alloc_wait_probe rc=$?"; tail -30 "$OUT/alloc_wait_probe.log"
SA_READY=1 SKIP_ENGINE=${SKIP_ENGINE-1} MS=${MS:-"1 16"} VARIANTS=${VARIANTS:-"b bh bwh bswh bnh"} \
  bash scripts/gpu/run_small_call_ab.sh "$1"
