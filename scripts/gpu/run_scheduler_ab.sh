#!/bin/bash
# Issue 12's scheduler checks for server variants in one device call, on the bundle of
# make_ab_bundle.sh (.bundle/ab.tgz: ab/bin/moeserve_a, moeserve_b, moeserve-cli; ab/lib): for
# each variant, seed layer MXFP8, closed loop 1 / 8 / 32 callers at M=16 (the 8-caller ratio),
# then the open-loop overload at twice the 32-caller capacity for 10 s against
# --max_queue_wait_ms $WAIT_MS (default 0.5; answered p99 against the 1-caller p99), ROUNDS (1)
# alternating rounds. A variant is "a" or "b" and server flags, '|'-separated in VARIANTS
# (default: a|b|b --lane_lead_us 100|b --lane_lead_us 150); a variant's --max_queue_wait_ms
# overrides WAIT_MS. RATE=N skips the closed loops and offers N calls/s (the unloaded p99 then
# comes from a 400-call single caller on the bounded server). Prints each overload's stage lines
# and the batcher's metrics after it, then one line per variant and round.
# CLI: another moeserve-cli (default the bundle's).
# The emulated-device twins of these runs (no GPU): tests/benchmarks/serving/run_emulated_*.sh.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/serve_lib.sh
use_tgz_bundle "${BUNDLE:-.bundle/ab.tgz}" ab || exit 1
BIN=$BUNDLE_BIN
B=/tmp/schedb && mkdir -p $B && cp "${CLI:-$BIN/moeserve-cli}" $B/moeserve-cli
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
IFS='|' read -r -a variants <<< "${VARIANTS:-a|b|b --lane_lead_us 100|b --lane_lead_us 150}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; date -u
for r in $(seq "${ROUNDS:-1}"); do
  i=0
  for v in "${variants[@]}"; do
    i=$((i + 1))
    read -r side flags <<< "$v"
    cp "$BIN/moeserve_$side" $B/moeserve
    t=v${i}_r$r
    # shellcheck disable=SC2086
    if [ -z "${RATE:-}" ]; then
      serve $t $SEED $flags
      load ${t}_c1 16 1 400
      load ${t}_c8 16 8 3200
      load ${t}_c32 16 32 8000
      stop
      rate=$(awk -v c="$(val ${t}_c32 requests_per_s)" 'BEGIN { printf "%.0f", 2 * c }')
    fi
    # shellcheck disable=SC2086
    serve ${t}_bounded $SEED --max_queue_wait_ms "${WAIT_MS:-0.5}" $flags
    if [ -n "${RATE:-}" ]; then
      rate=$RATE
      load ${t}_c1 16 1 400
      echo "== c8 n/a" > "$OUT/load_${t}_c8.log"
    fi
    timeout 120 $B/moeserve-cli load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
      --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 \
      > "$OUT/ovl_$t.log" 2>&1
    grep -E "latency_ms|server_" "$OUT/ovl_$t.log"
    curl -s "127.0.0.1:$((PORT + 1))/metrics" > "$OUT/metrics_$t.txt"
    grep -E "^moeserve_(batch_(calls|tokens)_(sum|count)|forward_refused_total)" \
      "$OUT/metrics_$t.txt"
    stop
    p99u=$(val ${t}_c1 p99)
    p99o=$(grep -o 'p99=[0-9.]*' "$OUT/ovl_$t.log" | head -1 | cut -d= -f2)
    echo "== [$v] round $r: 8 callers x$(ratio "$(val ${t}_c8 requests_per_s)" \
      "$(val ${t}_c1 requests_per_s)") (p50 $(val ${t}_c1 p50) -> $(val ${t}_c8 p50) ms);" \
      "overload at $rate/s: p99 $p99o ms = x$(ratio "$p99o" "$p99u") the unloaded $p99u;" \
      "$(grep -E '^sent=' "$OUT/ovl_$t.log")"
  done
done
