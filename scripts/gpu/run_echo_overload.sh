#!/usr/bin/env bash
# Is issue 12's overload (2x capacity, open loop, M=16 seed calls of 98 KB) beyond gRPC itself on
# this host? The same open loop against grpc_echo_bench's server (gRPC alone: a generic callback
# service that echoes or refuses, no protobuf, no engine), 4 client processes x 8 connections,
# 60 of every 100 calls refused RESOURCE_EXHAUSTED (moeserve's overload refused 58-62%), after
# reading the request or before it (--refuse_early); then moeserve's own overload at the same
# rate. Each case: the clients' latency from the schedule, the server's CPU cores, the host's
# busy and steal share.
# Usage: run_echo_overload.sh BUNDLE.tgz ECHO_BIN   (make_ab_bundle.sh; a stripped grpc_echo_bench)
#   RATE (27000), BYTES (98400), CASES ("after early after@13500 moeserve")
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50191 || exit 1
ECHO=$2
ln -sf "$B/moeserve_b" "$B/moeserve"
RATE=${RATE:-27000}
proc_cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
for c in ${CASES:-after early after@13500 moeserve}; do
  mode=${c%@*} rate=$RATE
  [ "$c" != "$mode" ] && rate=${c#*@}
  if [ "$mode" = moeserve ]; then
    serve ovl --model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8 \
      --max_queue_wait_ms 0.5 --max_batch_tokens 256
    pid=$SERVER_PID h0=$(cpu_mark) c0=$(proc_cpu $SERVER_PID) t0=$(date +%s.%N)
    CLIENTS=4 overload ovl "$rate"
    host=$(cpu_since "$h0") c1=$(proc_cpu $pid) t1=$(date +%s.%N)
    stop
    echo "== moeserve rate=$rate: $(grep -E '^sent=' "$OUT/load_ovl.log")"
    grep -E '^latency_from_schedule_ms|^server_total' "$OUT/load_ovl.log"
    for i in 1 2 3 4; do grep -o 'latency_ms_by_second_sent: .*' "$OUT/load_ovl.$i.log" | sed 's/,max=[0-9.]*//g' | cut -c1-330; done
  else
    rm -f /tmp/echo_ready
    "$ECHO" server --listen 127.0.0.1:50199 --ready_file /tmp/echo_ready --refuse_percent 60 \
      $([ "$mode" = early ] && echo --refuse_early) > "$OUT/echo_server_$c.log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do [ -s /tmp/echo_ready ] && break; sleep 0.1; done
    h0=$(cpu_mark) c0=$(proc_cpu $pid) t0=$(date +%s.%N)
    pids=()
    for i in 1 2 3 4; do
      timeout 90 "$ECHO" openloop --target 127.0.0.1:50199 --bytes "${BYTES:-98400}" \
        --rate "$(awk -v r="$rate" 'BEGIN { print r / 4 }')" --seconds 10 --connections 8 \
        > "$OUT/echo_$c.$i.log" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    host=$(cpu_since "$h0") c1=$(proc_cpu $pid) t1=$(date +%s.%N)
    kill $pid; wait $pid 2>/dev/null
    echo "== echo refuse-$mode rate=$rate (4 processes x 8 connections):"
    for i in 1 2 3 4; do cut -c1-330 "$OUT/echo_$c.$i.log"; done
  fi
  echo "   server $(awk -v a="$c0" -v b="$c1" -v s="$t0" -v e="$t1" 'BEGIN { printf "%.2f cores", (b - a) / 100 / (e - s) }') over $(awk -v s="$t0" -v e="$t1" 'BEGIN { printf "%.1f s", e - s }'); host $host"
done
