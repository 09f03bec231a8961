#!/bin/bash
# Forward round trip through moeserve-cli load (concurrency 1) against a server with trivial
# experts, so the transport dominates. Usage: run_transport.sh BIN_DIR LABEL [REQUESTS]
# BIN_DIR holds moeserve and moeserve-cli. Prints one line per (transport, M). SHM=1 adds a run
# whose tensors and answers go through a POSIX shared-memory region (moeserve-cli load --shm,
# server --enable_shared_memory; needs binaries that have them), labelled "shm".
set -euo pipefail
bin=$1 label=$2 n=${3:-60}
dir=$(mktemp -d)
trap 'kill $(cat $dir/pid) 2>/dev/null || true; rm -rf $dir' EXIT
port=$((20000 + RANDOM % 20000))
runs=("127.0.0.1:$port|" "unix:$dir/s.sock|")
[ "${SHM:-0}" = 1 ] && runs+=("unix:$dir/shm.sock|--shm")
for run in "${runs[@]}"; do
  listen=${run%%|*} shm=${run#*|}
  "$bin/moeserve" --model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 \
    --num_layers 1 --listen "$listen" --ready_file "$dir/ready" \
    ${shm:+--enable_shared_memory} > "$dir/server.log" 2>&1 &
  echo $! > "$dir/pid"
  for _ in $(seq 100); do [ -s "$dir/ready" ] && break; sleep 0.1; done
  for m in 1 64 1024; do
    out=$("$bin/moeserve-cli" load --target "$listen" --concurrency 1 --tokens $m --dtype bf16 \
      --requests $n --return_timings $shm 2>&1 || true)
    transport=${listen%%:*}
    [ -n "$shm" ] && transport=shm
    echo "$label $transport M=$m $(echo "$out" | grep -E 'latency_ms|server_total' | tr '\n' ' ')"
  done
  kill "$(cat $dir/pid)"; wait "$(cat $dir/pid)" 2>/dev/null || true; rm -f "$dir/ready"
done
