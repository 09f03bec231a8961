#!/bin/bash
# The serving benchmark's overload run (run_serving_bench.sh) on a machine without a GPU: servers
# built with the emulated device (moeserve_emulated: each step takes STEP_US + TOKEN_US x tokens,
# one step's experts at a time, as on a GPU), time scaled up (default 20x the seed layer's MXFP8
# decode on an H200: 8000 + 16 x tokens us) so that a small machine's cores are not what limits.
# For each server binary given, alternating ROUNDS times: one caller at M=16 (the unloaded p99),
# 32 closed-loop callers on the unbounded server (the capacity), then an open loop at twice that
# for 10 s against the server with --max_queue_wait_ms WAIT_MS (default 10: the bench's 0.5 ms,
# scaled): answered p50 / p99, refused, wrong answers.
#   run_emulated_overload.sh BIN [BIN...]   (moeserve_emulated builds; moeserve-cli from $CLI,
#                                            default build/bin/moeserve-cli)
set -uo pipefail
CLI=${CLI:-build/bin/moeserve-cli}
OUT=${OUT:-/tmp/emulated_overload}; mkdir -p "$OUT"
STEP_US=${STEP_US:-8000}; TOKEN_US=${TOKEN_US:-16}; WAIT_MS=${WAIT_MS:-10}; ROUNDS=${ROUNDS:-2}
PORT=${PORT:-50181}
MODEL="--model tiny --hidden 512 --intermediate 32 --num_experts 32 --topk 8 --num_layers 1"
serve() {  # serve BIN NAME FLAGS...
  local bin=$1 name=$2
  shift 2
  rm -f "$OUT/ready_$name"
  "$bin" $MODEL --experts emulated_device --emulate_step_us "$STEP_US" \
    --emulate_token_us "$TOKEN_US" --steps_in_flight 2 --listen 127.0.0.1:$PORT \
    --metrics_address 127.0.0.1:0 --ready_file "$OUT/ready_$name" "$@" > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 200); do [ -s "$OUT/ready_$name" ] && break; sleep 0.1; done
}
stop() { kill -TERM "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; }
val() { grep -o "$2=[0-9.]*" "$1" | head -1 | cut -d= -f2; }
printf '%-6s %-40s %9s %10s %9s %8s %8s %8s %7s\n' round binary unl_p99 capacity offered \
  answered p50_ms p99_ms x_unl
for r in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    tag=r${r}_$(basename "$bin")
    serve "$bin" "${tag}_unbounded"
    "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 1 --requests 200 \
      --routing balanced > "$OUT/${tag}_c1.log" 2>&1
    "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 32 --requests 3200 \
      --routing balanced > "$OUT/${tag}_c32.log" 2>&1
    stop
    cap=$(val "$OUT/${tag}_c32.log" requests_per_s)
    rate=$(awk -v c="$cap" 'BEGIN { printf "%.0f", 2 * c }')
    serve "$bin" "${tag}_bounded" --max_queue_wait_ms "$WAIT_MS"
    timeout 120 "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
      --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 \
      > "$OUT/${tag}_overload.log" 2>&1
    stop
    p99u=$(val "$OUT/${tag}_c1.log" p99)
    o=$OUT/${tag}_overload.log
    p99o=$(val "$o" p99)
    printf '%-6s %-40s %9s %10s %9s %8s %8s %8s %7s\n' "$r" "$bin" "$p99u" "$cap" "$rate" \
      "$(val "$o" ok)" "$(val "$o" p50)" "$p99o" \
      "$(awk -v a="$p99o" -v b="$p99u" 'BEGIN { printf "%.2f", a / b }')"
    grep -E "^sent=|first error" "$o" | sed 's/^/    /'
  done
done
