#!/bin/bash
# The serving benchmark's overload run (run_serving_bench.sh) on a machine without a GPU: servers
# built with the emulated device (moeserve_emulated: each step takes STEP_US + TOKEN_US x tokens,
# one step's experts at a time, as on a GPU), time scaled up (default 20x the seed layer's MXFP8
# decode on an H200: 8000 + 16 x tokens us) so that a small machine's cores are not what limits.
# For each server binary given, alternating ROUNDS times: one caller at M=16 (the unloaded p99),
# 32 closed-loop callers on the unbounded server (the capacity), then an open loop at twice that
# for 10 s against the server with --max_queue_wait_ms WAIT_MS (default 10: the bench's 0.5 ms,
# scaled): answered p50 / p99, refused, wrong answers. HOST_US (default 0) adds host work per
# step outside the device lock, as run_emulated_callers.sh does (1200 there). LAYERS=L (default 1) spreads the callers
# and the open loop over L layers (one moeserve-cli per layer, at once; their calls never share
# a step): the capacity and the answered calls are summed, p50 / p99 are the worst layer's.
#   run_emulated_overload.sh BIN [BIN...]   (moeserve_emulated builds; moeserve-cli from $CLI,
#                                            default build/bin/moeserve-cli)
# A BIN may carry server flags after it, in one argument: "build/bin/moeserve_emulated
# --lane_lead_us 2000".
set -uo pipefail
CLI=${CLI:-build/bin/moeserve-cli}
OUT=${OUT:-/tmp/emulated_overload}; mkdir -p "$OUT"
STEP_US=${STEP_US:-8000}; TOKEN_US=${TOKEN_US:-16}; WAIT_MS=${WAIT_MS:-10}; ROUNDS=${ROUNDS:-2}
HOST_US=${HOST_US:-0}  # host work per step outside the device lock (run_emulated_callers.sh's)
PORT=${PORT:-50181}
LAYERS=${LAYERS:-1}
MODEL="--model tiny --hidden 512 --intermediate 32 --num_experts 32 --topk 8 --num_layers $LAYERS"
serve() {  # serve BIN NAME FLAGS...
  local bin name=$2
  read -r -a bin <<< "$1"
  shift 2
  rm -f "$OUT/ready_$name"
  "${bin[@]}" $MODEL --experts emulated_device --emulate_step_us "$STEP_US" \
    --emulate_token_us "$TOKEN_US" --emulate_host_us "$HOST_US" --steps_in_flight 2 --listen 127.0.0.1:$PORT \
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
    tag=r${r}_$(echo "$bin" | sed 's|.*/||; s/[^A-Za-z0-9_]/_/g')
    serve "$bin" "${tag}_unbounded"
    "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 1 --requests 200 \
      --routing balanced > "$OUT/${tag}_c1.log" 2>&1
    for l in $(seq 0 $((LAYERS - 1))); do
      "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --concurrency $((32 / LAYERS)) \
        --requests $((3200 / LAYERS)) --layer $l --routing balanced > "$OUT/${tag}_c32_l$l.log" 2>&1 &
    done
    wait $(jobs -p | grep -v "^$SERVER_PID$") 2>/dev/null
    stop
    cap=$(cat "$OUT/${tag}"_c32_l*.log | grep -o "requests_per_s=[0-9.]*" | cut -d= -f2 |
      awk '{ s += $1 } END { printf "%.1f", s }')
    rate=$(awk -v c="$cap" -v l="$LAYERS" 'BEGIN { printf "%.0f", 2 * c / l }')
    serve "$bin" "${tag}_bounded" --max_queue_wait_ms "$WAIT_MS"
    for l in $(seq 0 $((LAYERS - 1))); do
      timeout 120 "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
        --concurrency $((32 / LAYERS)) --max_seconds 10 --routing balanced --distinct_inputs 8 \
        --layer $l > "$OUT/${tag}_overload_l$l.log" 2>&1 &
    done
    wait $(jobs -p | grep -v "^$SERVER_PID$") 2>/dev/null
    stop
    p99u=$(val "$OUT/${tag}_c1.log" p99)
    ok=$(cat "$OUT/${tag}"_overload_l*.log | grep -o "^sent=[0-9]* ok=[0-9]*" | cut -d= -f3 |
      awk '{ s += $1 } END { print s }')
    p50o=$(cat "$OUT/${tag}"_overload_l*.log | grep -o "latency_ms: p50=[0-9.]*" | cut -d= -f2 |
      sort -g | tail -1)
    p99o=$(cat "$OUT/${tag}"_overload_l*.log | grep -o "latency_ms: p50=[0-9.]* p90=[0-9.]* p99=[0-9.]*" |
      sed 's/.*p99=//' | sort -g | tail -1)
    printf '%-6s %-40s %9s %10s %9s %8s %8s %8s %7s\n' "$r" "$bin" "$p99u" "$cap" \
      "$((rate * LAYERS))" "$ok" "$p50o" "$p99o" \
      "$(awk -v a="$p99o" -v b="$p99u" 'BEGIN { printf "%.2f", a / b }')"
    grep -hE "^sent=|first error" "$OUT/${tag}"_overload_l*.log | sed 's/^/    /'
  done
done
