#!/usr/bin/env bash
# Issue 12's overload (seed MXFP8, M=16, 32 connections, 10 s, --max_queue_wait_ms 0.5) with the
# open loop sent by 1, 2 or 4 threads (moeserve-cli load --senders), on one server (build b of
# the bundle), after a warm-up overload; the unloaded p99 (one caller, 400 calls) before and after.
# Usage: run_s37_senders.sh BUNDLE.tgz   (RATE, default 20000; ORDER, default "1 4 2 4 1 2")
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50171 || exit 1
ln -sf "$B/moeserve_b" "$B/moeserve"
serve s --model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8 \
  --max_queue_wait_ms 0.5 ${SERVER_FLAGS:-}
load c1_before 16 1 400
ovl() {  # ovl TAG SENDERS SECONDS
  timeout 60 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens 16 --rate "${RATE:-20000}" \
    --concurrency 32 --max_seconds "$3" --routing balanced --distinct_inputs 8 --senders "$2" \
    > "$OUT/ovl_$1.log" 2>&1
}
ovl warm 1 3
i=0
for s in ${ORDER:-1 4 2 4 1 2}; do
  i=$((i + 1))
  ovl "$i" "$s" 10
  echo "senders=$s: $(grep -E '^sent=' "$OUT/ovl_$i.log" | cut -d' ' -f2-4)" \
    "| sched $(grep -E '^latency_from_schedule' "$OUT/ovl_$i.log" | grep -o 'p50=[0-9.]* p90=[0-9.]* p99=[0-9.]*')" \
    "| send $(grep -E '^latency_ms:' "$OUT/ovl_$i.log" | grep -o 'p50=[0-9.]* p90=[0-9.]* p99=[0-9.]*')" \
    "| lag $(grep -E '^send_lag' "$OUT/ovl_$i.log" | grep -o 'p99=[0-9.]*')" \
    "| server $(grep -E '^server_total' "$OUT/ovl_$i.log" | grep -o 'p99=[0-9.]*')"
done
load c1_after 16 1 400
stop
echo "unloaded p99 before $(val c1_before p99) ms, after $(val c1_after p99) ms"
