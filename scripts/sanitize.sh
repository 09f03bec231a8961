#!/usr/bin/env bash
# Builds the CPU test suites with clang, AddressSanitizer and UndefinedBehaviorSanitizer (in
# build-asan/, the build directory scripts/fuzz.sh uses too: the libraries are built once for
# both) and runs them. Any sanitizer report fails the test that triggered it.
#
#   scripts/sanitize.sh          # every CPU suite (ctest -L cpu); its last run is recorded in
#                                # tests/fuzz/RESULTS.md
#   scripts/sanitize.sh --ci     # the subset .ci/run runs (CI_SUITES below)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SANITIZE_BUILD_DIR:-build-asan}
JOBS=${JOBS:-$(nproc)}
# The suites CI runs sanitized: what a client or a checkpoint reaches (wire decoding, the forward
# channel's slots, tensor and size checks, the batcher, cancellation, the server's limits and
# accounting, the loaders, the in-process collectives and a follower's checks of its leader's
# commands).
CI_SUITES=(core_test proto_forward_wire_test engine_test engine_cancellation_test
           safetensors_test checkpoint_test server_convert_test server_limits_test
           server_metrics_http_test server_buffer_pool_test server_forward_channel_test
           ep_comm_test multiprocess_driver_test)

scripts/configure_sanitizers.sh "$BUILD_DIR"
# allocator_may_return_null: allocation failures are errors the code handles (Tensor::Allocate).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# OpenBLAS's threads and gRPC's background threads outlive main in places; LeakSanitizer
# suppressions for third-party code only.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/scripts/lsan_suppressions.txt:print_suppressions=0}

start=$(date +%s)
if [[ "${1:-}" == "--ci" ]]; then
  ninja -C "$BUILD_DIR" -j"$JOBS" "${CI_SUITES[@]}"
  echo "sanitize: built in $(($(date +%s) - start)) s"
  # checkpoint_test reads the checkpoints the CTest fixture writes.
  ctest --test-dir "$BUILD_DIR" -R '^checkpoint_make_test_checkpoints$' --output-on-failure >/dev/null
  status=0
  for suite in "${CI_SUITES[@]}"; do
    bin=$(find "$BUILD_DIR/tests" -name "$suite" -type f -perm -u+x | head -1)
    t0=$(date +%s)
    if "$bin" --gtest_brief=1 >"$BUILD_DIR/$suite.log" 2>&1; then
      echo "sanitize: $suite ok ($(($(date +%s) - t0)) s)"
    else
      echo "sanitize: $suite FAILED (log $BUILD_DIR/$suite.log):" >&2
      grep -E "ERROR: |runtime error|FAILED|SUMMARY" "$BUILD_DIR/$suite.log" | head -20 >&2 || true
      status=1
    fi
  done
  exit $status
fi
ninja -C "$BUILD_DIR" -j"$JOBS"
echo "sanitize: built in $(($(date +%s) - start)) s"
ctest --test-dir "$BUILD_DIR" -L cpu -j"${CTEST_JOBS:-$JOBS}" --output-on-failure
