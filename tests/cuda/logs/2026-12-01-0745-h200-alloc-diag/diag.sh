#!/bin/bash
# Diagnosis: where the server spends its time at M=1024 (seed layer), default malloc vs a
# malloc that keeps large blocks (no mmap/munmap per call).
export LD_LIBRARY_PATH=$PWD/.bundle/lib
B=.bundle/bin
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
run() {  # tag env...
  local tag=$1; shift
  rm -f /tmp/ready_d
  env "$@" $B/moeserve --listen 127.0.0.1:50095 --metrics_address "" --ready_file /tmp/ready_d $SEED > /tmp/srv_d.log 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do [ -f /tmp/ready_d ] && break; sleep 0.5; done
  for i in 1 2 3; do $B/moeserve-cli forward --target 127.0.0.1:50095 --tokens 1024 --seed $i 2>&1 | grep -iE "timings|latency|queue" | tr '\n' ' '; echo; done | sed "s/^/$tag: /"
  echo "$tag load: $($B/moeserve-cli load --target 127.0.0.1:50095 --tokens 1024 --concurrency 1 --requests 40 2>&1 | grep -E 'latency|server_total' | tr '\n' ' ')"
  kill -TERM $pid; wait $pid
}
run default X=1
run keep_blocks MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912 MALLOC_TOP_PAD_=67108864
B0=$B; cp $B/moeserve_base /tmp/moeserve_b; run_base() { rm -f /tmp/ready_d; /tmp/moeserve_b --listen 127.0.0.1:50095 --metrics_address "" --ready_file /tmp/ready_d $SEED > /tmp/srv_d.log 2>&1 & local pid=$!; for i in $(seq 1 240); do [ -f /tmp/ready_d ] && break; sleep 0.5; done; for i in 1 2 3; do $B/moeserve-cli forward --target 127.0.0.1:50095 --tokens 1024 --seed $i 2>&1 | grep -iE "timings|latency|queue" | tr '\n' ' '; echo; done | sed "s/^/base: /"; kill -TERM $pid; wait $pid; }
run_base
