#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer in build-asan/ (shared with scripts/sanitize.sh; only the libraries
# the targets need: core, proto, kernels), then fuzzes each for FUZZ_SECONDS (default 45)
# starting from its committed seed corpus. Any crash, sanitizer report, leak, or a target's own
# check failing ends the script non-zero, with the reproducer left in
# $FUZZ_DIR/artifacts/<target>/.
#
#   scripts/fuzz.sh                     # all four, 45 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh forward_request
#
# Reproduce a finding: build-asan/tests/fuzz/fuzz_<target> <artifact file>
# New inputs the fuzzer found are kept in $FUZZ_DIR/corpus/<target> (not committed; copy a useful
# one into tests/fuzz/corpus/<target>/ to make it a regression seed).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SANITIZE_BUILD_DIR:-build-asan}
FUZZ_DIR=${FUZZ_DIR:-$BUILD_DIR/fuzz-run}
SECONDS_EACH=${FUZZ_SECONDS:-45}
JOBS=${JOBS:-$(nproc)}
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=(forward_request safetensors hf_config mxfp8)

scripts/configure_sanitizers.sh "$BUILD_DIR"
start=$(date +%s)
ninja -C "$BUILD_DIR" -j"$JOBS" $(printf 'fuzz_%s ' "${TARGETS[@]}")
echo "fuzz: built in $(($(date +%s) - start)) s"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# One target per core at a time (each libFuzzer process is single-threaded).
PARALLEL=${FUZZ_PARALLEL:-$(nproc)}
fuzz_one() {
  local t=$1 corpus="$FUZZ_DIR/corpus/$1" artifacts="$FUZZ_DIR/artifacts/$1" t0
  mkdir -p "$corpus" "$artifacts"
  t0=$(date +%s)
  # New inputs go to the run's own corpus; the committed seeds are read only.
  if "$BUILD_DIR/tests/fuzz/fuzz_$t" "$corpus" "tests/fuzz/corpus/$t" \
      -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
      -artifact_prefix="$artifacts/" -print_final_stats=1 >"$FUZZ_DIR/$t.log" 2>&1; then
    local runs
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$FUZZ_DIR/$t.log" | grep -o '[0-9]*$')
    echo "fuzz: $t ok: ${runs:-?} inputs in $(($(date +%s) - t0)) s"
  else
    echo "fuzz: $t FAILED (log $FUZZ_DIR/$t.log, reproducer in $artifacts/):" >&2
    grep -E "ERROR|violated|SUMMARY|runtime error" "$FUZZ_DIR/$t.log" | head -20 >&2 || true
    return 1
  fi
}
mkdir -p "$FUZZ_DIR"
status=0
pids=()
for t in "${TARGETS[@]}"; do
  fuzz_one "$t" &
  pids+=($!)
  if ((${#pids[@]} >= PARALLEL)); then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
