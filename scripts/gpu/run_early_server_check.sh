#!/usr/bin/env bash
# The second device call for the decode GEMMs' early weights (run_early_weights_ab.sh is the
# first), on a bundle whose bin/ holds moeserve_a and moeserve_b (the same build), moeserve-cli,
# engine_forward_bench_b and engine_cuda_test: the graphed engine's GPU tests, then the server's
# small calls with the weights fetched after the wait ("be", MOESERVE_EARLY_WEIGHTS=0) and before
# it ("b"), trivial and seed layers, M = 1, 16, 64, ROUNDS (2) alternating rounds
# (run_small_call_ab.sh),
# then issue 12's overload (seed layer MXFP8, M=16, 21,000 calls/s for 10 s) on a server started
# with --warm_graphs, twice on the same server (run_overload_cpu_diag.sh), which shows whether the
# client-side tail of the fresh servers measured before came from graph captures, then the same
# with the client's completions on 4 shared queues (moeserve-cli --completion_threads 4).
# SKIP_ENGINE_TEST=1 skips engine_cuda_test (a call before ran it).
# Usage: run_early_server_check.sh BUNDLE.tgz (writes under $OUT).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
[ -z "${SKIP_ENGINE_TEST:-}" ] && run_gtest engine_cuda_test 300
# The CUDA shared-memory suite starts the bundle's server ($MOESERVE_BINARY: not the build tree's).
MOESERVE_BINARY=$B/moeserve_b run_gtest shared_memory_cuda_test 120
for layer in trivial seed; do
  OUT=$OUT/$layer SERVER_LAYER=$layer SKIP_GPU_SUITES=1 SKIP_SUITES=1 SKIP_ENGINE=1 \
    VARIANTS="be b" bash scripts/gpu/run_small_call_ab.sh "$1" 2>&1 | tail -8
done
REPEAT=2 BUNDLE="$1" \
  CASES=${CASES:-21000 - - b --warm_graphs|21000 - - b --warm_graphs :: --completion_threads 4} \
  bash scripts/gpu/run_overload_cpu_diag.sh 2>&1 | tail -40
