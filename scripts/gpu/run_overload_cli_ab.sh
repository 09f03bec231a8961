#!/bin/bash
# Overload check: new server (bundle sv), closed-loop 1/8/32 callers, then the open-loop overload
# with the new moeserve-cli and with the old one (3be34ed), against --max_queue_wait_ms 0.5.
set -u
source scripts/gpu/serve_lib.sh
use_sv_bundle || exit 1
B=$SV_BIN
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
serve seed $SEED
load M16_c1 16 1 400
load M16_c8 16 8 3200
load M16_c32 16 32 8000
stop
cap=$(val M16_c32 requests_per_s)
rate=$(awk -v c="$cap" 'BEGIN { printf "%.0f", 2 * c }')
for cli in new old new old; do
  if [ $cli = old ]; then cp $B/moeserve-cli_old /tmp/cli_run; else cp $B/moeserve-cli /tmp/cli_run; fi
  serve bounded_$cli $SEED --max_queue_wait_ms 0.5
  timeout 120 /tmp/cli_run load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
    --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 > $OUT/ovl_$cli.log 2>&1
  echo "== overload $cli cli rate=$rate: $(grep -E '^sent=|latency_ms' $OUT/ovl_$cli.log | tr '\n' ' ')"
  stop
done
t1=$(val M16_c1 requests_per_s); t8=$(val M16_c8 requests_per_s)
echo "8 callers: x$(ratio $t8 $t1); p50 x$(ratio $(val M16_c8 p50) $(val M16_c1 p50)); unloaded p99 $(val M16_c1 p99) ms"
