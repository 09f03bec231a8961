#!/bin/bash
# The serving benchmark's "8 callers against one" (run_serving_bench.sh) on a machine without a
# GPU: moeserve_emulated (each step: HOST_US of host work, then STEP_US + TOKEN_US x tokens on one
# device lock), time scaled up (default 20x an H200's seed MXFP8 decode step: 1200 us host, 8000 +
# 16 x tokens us device), each caller's turnaround scaled alike (--think_us THINK_US, default 5000:
# 20x the 256 us an H200 host's client and loopback add to a call). For each server variant (a
# quoted string of server flags; "-" for none), alternating ROUNDS times: 1 caller and CALLERS (8)
# callers at M=16, closed loop; prints calls/s, the ratio, p50s, and steps per call.
#   run_emulated_callers.sh BIN "VARIANT FLAGS" ["VARIANT FLAGS"...]
set -uo pipefail
CLI=${CLI:-build/bin/moeserve-cli}
OUT=${OUT:-/tmp/emulated_callers}; mkdir -p "$OUT"
STEP_US=${STEP_US:-8000}; TOKEN_US=${TOKEN_US:-16}; HOST_US=${HOST_US:-1200}
THINK_US=${THINK_US:-5000}; ROUNDS=${ROUNDS:-2}; CALLERS=${CALLERS:-8}; N=${N:-60}
PORT=${PORT:-50191}
MODEL="--model tiny --hidden 512 --intermediate 32 --num_experts 32 --topk 8 --num_layers 1"
BIN=$1
shift
val() { grep -o "$2=[0-9.]*" "$1" | head -1 | cut -d= -f2; }
printf '%-5s %-36s %9s %9s %6s %8s %8s %10s\n' round variant c1_per_s cN_per_s ratio c1_p50 cN_p50 \
  calls/step
for r in $(seq "$ROUNDS"); do
  i=0
  for flags in "$@"; do
    i=$((i + 1))
    [ "$flags" = "-" ] && flags=""
    rm -f "$OUT/ready"
    # shellcheck disable=SC2086
    "$BIN" $MODEL --experts emulated_device --emulate_step_us "$STEP_US" \
      --emulate_token_us "$TOKEN_US" --emulate_host_us "$HOST_US" --steps_in_flight 2 \
      --listen 127.0.0.1:$PORT --metrics_address 127.0.0.1:$((PORT + 1)) \
      --ready_file "$OUT/ready" $flags > "$OUT/server_r${r}_v$i.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 200); do [ -s "$OUT/ready" ] && break; sleep 0.1; done
    "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --concurrency 1 --requests "$N" \
      --think_us "$THINK_US" --routing balanced > "$OUT/r${r}_v${i}_c1.log" 2>&1
    m0=$(curl -s http://127.0.0.1:$((PORT + 1))/metrics | awk '/^moeserve_batch_calls_count/ {print $2}')
    "$CLI" load --target 127.0.0.1:$PORT --tokens 16 --concurrency "$CALLERS" \
      --requests $((N * CALLERS)) --think_us "$THINK_US" --routing balanced \
      > "$OUT/r${r}_v${i}_cN.log" 2>&1
    m1=$(curl -s http://127.0.0.1:$((PORT + 1))/metrics | awk '/^moeserve_batch_calls_count/ {print $2}')
    kill -TERM $pid; wait $pid 2>/dev/null
    a=$(val "$OUT/r${r}_v${i}_c1.log" requests_per_s); b=$(val "$OUT/r${r}_v${i}_cN.log" requests_per_s)
    printf '%-5s %-36s %9s %9s %6s %8s %8s %10s\n' "$r" "${flags:--}" "$a" "$b" \
      "$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", b / a }')" \
      "$(val "$OUT/r${r}_v${i}_c1.log" p50)" "$(val "$OUT/r${r}_v${i}_cN.log" p50)" \
      "$(awk -v s="$((m1 - m0))" -v n="$((N * CALLERS))" 'BEGIN { if (s > 0) printf "%.2f", n / s }')"
  done
done
