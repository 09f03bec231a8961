#!/usr/bin/env bash
# Issue 12's overload on a fresh server (seed MXFP8, M=16, 32 connections, 10 s, RATE calls/s,
# --max_queue_wait_ms 0.5), as the serving benchmark runs it, with and without --warm_graphs
# (every CUDA graph size captured before serving), ROUNDS alternating rounds: the answered p99
# from the schedule, the first second's p99 (where a fresh server's tail sat), the unloaded p99
# (one caller, 400 calls, after) and the warm-up's time. Usage: run_s37_warm.sh BUNDLE.tgz
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50171 || exit 1
ln -sf "$B/moeserve_b" "$B/moeserve"
for r in $(seq "${ROUNDS:-2}"); do for v in $(round_order "$r" plain warm); do
  t=${v}_$r
  extra=""; [ $v = warm ] && extra=--warm_graphs
  # shellcheck disable=SC2086
  serve $t --model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8 \
    --max_queue_wait_ms 0.5 $extra
  timeout 60 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 --rate "${RATE:-24000}" \
    --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 > "$OUT/ovl_$t.log" 2>&1
  load ${t}_c1 16 1 400
  stop
  echo "$t: unloaded p99 $(val ${t}_c1 p99) | $(grep -E '^sent=' "$OUT/ovl_$t.log" | cut -d' ' -f2-3)" \
    "| sched $(grep -E '^latency_from_schedule' "$OUT/ovl_$t.log" | grep -o 'p50=[0-9.]* p90=[0-9.]* p99=[0-9.]*')" \
    "| lag p99 $(grep -E '^send_lag' "$OUT/ovl_$t.log" | grep -o 'p99=[0-9.]*' | cut -d= -f2)" \
    "| $(grep -E '^latency_ms_by' "$OUT/ovl_$t.log" | grep -o 's[01]:[^ ]*' | tr '\n' ' ')" \
    "| $(grep -o 'graphs warmed in [0-9]* ms' "$OUT/server_$t.log")"
done; done
