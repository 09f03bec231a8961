#!/usr/bin/env bash
# One device call: issue 12's overload run against several --max_queue_wait_ms bounds. First,
# on a server of the seed per-rank layer (MXFP8) without a bound: one caller at M=16 (the unloaded
# p99) and 32 closed-loop callers (the capacity; a bounded server refuses some of them, which
# would understate it). Then for each bound WAITS ("0.5 0.75 1"): an open loop at 2x that capacity for
# 10 s over 32 connections (every answer checked against its unloaded answer). Prints answered
# p99 / unloaded p99 per bound. Usage: run_overload.sh TRANSPORT_BUNDLE.tar.xz
# (make_bundle.sh). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PORT=50171
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
row() { echo "== $1: $2"; }
source "$(dirname "$0")/../../../scripts/gpu/serve_lib.sh"
use_bundle "$1" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
serve unbounded $SEED
load c1 16 1 400
load c32 16 32 8000
stop
cap=$(val c32 requests_per_s)
rate=$(awk -v c="$cap" 'BEGIN { printf "%.0f", 2 * c }')
p99u=$(grep -o 'p99=[0-9.]*' "$OUT/load_c1.log" | head -1 | cut -d= -f2)
for w in ${WAITS:-0.5 0.75 1}; do
  serve bound_$w $SEED --max_queue_wait_ms "$w"
  overload "overload_$w" "$rate"  # 2x $cap
  stop
  p99o=$(grep -o 'p99=[0-9.]*' "$OUT/load_overload_$w.log" | head -1 | cut -d= -f2)
  echo "bound $w ms: unloaded p99 $p99u ms, overload answered p99 $p99o ms: x$(ratio "$p99o" "$p99u") [< 5]"
done
