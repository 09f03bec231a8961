#!/bin/bash
# Issue 12's overload check for two server builds in one device call (bundle .bundle/sv.tgz:
# sv/bin/moeserve = new, moeserve_old = before, one moeserve-cli; sv/lib): for each, seed layer
# MXFP8, closed-loop 1 / 8 / 32 callers at M=16, then the open-loop overload at 2x the 32-caller
# capacity against --max_queue_wait_ms 0.5, ROUNDS (2) alternating rounds.
set -u
source scripts/gpu/serve_lib.sh
use_sv_bundle || exit 1
BIN=$SV_BIN
B=/tmp/svb && mkdir -p $B && cp $BIN/moeserve-cli $B/
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
for r in $(seq ${ROUNDS:-2}); do for v in old new; do
  if [ $v = old ]; then cp $BIN/moeserve_old $B/moeserve; else cp $BIN/moeserve $B/moeserve; fi
  serve ${v}_$r $SEED
  load ${v}_${r}_c1 16 1 400
  load ${v}_${r}_c8 16 8 3200
  load ${v}_${r}_c32 16 32 8000
  stop
  rate=$(awk -v c="$(val ${v}_${r}_c32 requests_per_s)" 'BEGIN { printf "%.0f", 2 * c }')
  serve ${v}_${r}_bounded $SEED --max_queue_wait_ms 0.5
  timeout 120 $B/moeserve-cli load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
    --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 > $OUT/ovl_${v}_$r.log 2>&1
  stop
  echo "== $v round $r: 8 callers x$(ratio $(val ${v}_${r}_c8 requests_per_s) $(val ${v}_${r}_c1 requests_per_s)), unloaded p99 $(val ${v}_${r}_c1 p99) ms; overload rate=$rate: $(grep -E '^sent=|latency_ms' $OUT/ovl_${v}_$r.log | tr '\n' ' ')"
done; done
