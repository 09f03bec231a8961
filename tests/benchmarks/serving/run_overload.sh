#!/bin/bash
# The serving benchmark's overload run alone (issue 12), for comparing server settings in one
# device call: a seed-layer MXFP8 server with --max_queue_wait_ms 3 plus EXTRA flags; capacity
# from 32 closed-loop callers at M=16; then an open loop at 2x that rate for 10 s, every answer
# checked against its unloaded answer; server RSS sampled. One summary line.
# Usage: run_overload.sh BIN_DIR TAG [extra server flags...]
set -uo pipefail
B=$1 TAG=$2; shift 2
OUT=${OUT:-/tmp/overload}; mkdir -p "$OUT"
PORT=50171
source "$(dirname "$0")/../../../scripts/gpu/serve_lib.sh"
serve "$TAG" --model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8 \
  --max_queue_wait_ms 3 "$@"
PID=$SERVER_PID
timeout 60 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 1 \
  --requests 300 --routing balanced > "$OUT/c1_$TAG.log" 2>&1
timeout 90 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 32 \
  --requests 8000 --routing balanced --max_seconds 30 > "$OUT/c32_$TAG.log" 2>&1
cap=$(grep -o 'requests_per_s=[0-9.]*' "$OUT/c32_$TAG.log" | cut -d= -f2)
rate=$(awk -v c="$cap" 'BEGIN { printf "%.0f", 2 * c }')
rss0=$(awk '/VmRSS/ {print $2}' /proc/$PID/status)
( while kill -0 $PID 2>/dev/null; do awk '/VmRSS/ {print $2}' /proc/$PID/status; sleep 0.25; done ) \
  > "$OUT/rss_$TAG.txt" &
RSS=$!
timeout 120 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" --concurrency 32 \
  --max_seconds 10 --routing balanced --distinct_inputs 8 > "$OUT/open_$TAG.log" 2>&1
kill $RSS 2>/dev/null
peak=$(sort -n "$OUT/rss_$TAG.txt" | tail -1)
end=$(awk '/VmRSS/ {print $2}' /proc/$PID/status)
stop
p99u=$(grep -o 'p99=[0-9.]*' "$OUT/c1_$TAG.log" | head -1 | cut -d= -f2)
echo "overload $TAG: capacity ${cap}/s, offered ${rate}/s; unloaded p99 ${p99u} ms;" \
  "$(grep -E '^sent=|latency_ms' "$OUT/open_$TAG.log" | tr '\n' ' ')" \
  "RSS kB before=$rss0 peak=$peak after=$end"
