#!/usr/bin/env bash
# The decode GEMMs' weights requested before they wait for the kernel before them
# (MoeGemmParams::weights_before_wait) on and off in one build, one device call: the kernel tests
# and the experts sweep (engine_cuda_test: run_early_server_check.sh), racecheck on the chain
# test and the cluster tile, then engine_forward_bench (trivial layer BF16 and seed MXFP8 at 1,
# 16 and 64 tokens, timed) with both off (MOESERVE_EARLY_WEIGHTS=0), W2 only
# (MOESERVE_W13_EARLY=0) and both on (the default), and moe_experts_bench's decode path (FORMATS,
# default bf16,mxfp8; LAYERS, default seed,dsv3; TOKENS, default 1,16,64,128) with both off and
# both on; settings alternating, rounds FIRST_ROUND (default 1) to ROUNDS (default 2), medians.
# Usage: run_early_weights_ab.sh BUNDLE.tgz (bin/: engine_forward_bench, moe_experts_bench, the
# tests).
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
run_gtest cuda_kernels_test 200
run_gtest cuda_experts_test 400
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$cs" ] && timeout 240 "$cs" --tool racecheck --error-exitcode 3 "$B/cuda_kernels_test" \
  --gtest_filter='*WeightsBeforeWait*:*DecodePair*' > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|PASSED|FAILED' "$OUT/racecheck.log" | tr '\n' ' ')"
# with_setting SETTING CMD...: CMD under off (both 0), w2 (W13 0) or on (neither set).
with_setting() {
  local set=$1
  shift
  case $set in
    off) MOESERVE_EARLY_WEIGHTS=0 "$@" ;;
    w2) MOESERVE_W13_EARLY=0 "$@" ;;
    *) "$@" ;;
  esac
}
CSV=$OUT/engine_early.csv
for round in $(seq "${FIRST_ROUND:-1}" "${ROUNDS:-2}"); do for set in $(round_order $round off w2 on); do
  engine_bench_rows $set "$CSV" 1,16,64 400 with_setting $set
done; done
echo "== engine_forward_bench, medians: model tokens setting -> wall p50 us, experts stage us"
engine_summary "$CSV"
echo "== moe_experts_bench decode path, both off against both on"
FORMATS=${FORMATS:-bf16,mxfp8} LAYERS=${LAYERS:-seed,dsv3} TOKENS=${TOKENS:-1,16,64,128} \
  decode_bench_env
DCSV=$OUT/decode_early.csv
for round in $(seq "${FIRST_ROUND:-1}" "${ROUNDS:-2}"); do for set in $(round_order $round off on); do
  with_setting $set timeout 150 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
    awk -F, -v s="$set" '{print s","$0}' >> "$DCSV"
done; done
decode_summary "$DCSV" off on
