#!/bin/bash
# 8 clients x 16 tokens vs 1 client, seed layer, by --server_threads and --max_batch_delay_us.
export LD_LIBRARY_PATH=$PWD/.bundle/lib
B=.bundle/bin
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
for cfg in "2 0" "8 0" "8 100"; do
  set -- $cfg
  rm -f /tmp/ready_b
  $B/moeserve --listen 127.0.0.1:50096 --metrics_address "" --ready_file /tmp/ready_b $SEED --server_threads $1 --max_batch_delay_us $2 > /tmp/srv_b.log 2>&1 &
  pid=$!
  for i in $(seq 1 240); do [ -f /tmp/ready_b ] && break; sleep 0.5; done
  one=$($B/moeserve-cli load --target 127.0.0.1:50096 --tokens 16 --concurrency 1 --requests 300 --routing balanced | grep -E "latency_ms|requests_per_s" | sed 's/tokens_per_s.*//' | tr '\n' ' ')
  eight=$($B/moeserve-cli load --target 127.0.0.1:50096 --tokens 16 --concurrency 8 --requests 2000 --routing balanced | grep -E "latency_ms|requests_per_s" | sed 's/tokens_per_s.*//' | tr '\n' ' ')
  echo "threads=$1 delay_us=$2 | 1 client: $one | 8 clients: $eight"
  kill -TERM $pid; wait $pid
done
