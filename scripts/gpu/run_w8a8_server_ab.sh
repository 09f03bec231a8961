#!/bin/bash
# One device call: what a client sees of W8A8 (issue 13) and of more gather threads (issue 11).
#   1. the seed per-rank layer (MXFP8) through moeserve-cli over TCP at M = 64, 256, 1024 with
#      the default experts (cuda: decode kernels / BF16-copy grouped GEMM) and --experts cuda_w8a8;
#   2. the trivial layer at M = 1024 over TCP with --gather_threads 4 (default) and 8.
# Both through run_flags_ab.sh (sets alternating, ROUNDS rounds, medians). Usage:
#   run_w8a8_server_ab.sh TRANSPORT_BUNDLE
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CONFIGS="defaults|--experts cuda_w8a8" LAYERS=seed MS="64 256 1024" WAYS=tcp \
  ROUNDS=${ROUNDS:-2} BUDGET_S=120 OUT=/tmp/ab_w8a8 \
  bash "$repo/tests/benchmarks/transport/run_flags_ab.sh" "$1" 2>&1 | tail -9
mkdir -p "$OUT/w8a8" && cp /tmp/ab_w8a8/*.txt "$OUT/w8a8/" 2>/dev/null
CONFIGS="defaults|--gather_threads=8" LAYERS=trivial MS=1024 WAYS=tcp \
  ROUNDS=${ROUNDS:-2} BUDGET_S=90 OUT=/tmp/ab_gather \
  bash "$repo/tests/benchmarks/transport/run_flags_ab.sh" "$1" 2>&1 | tail -5
mkdir -p "$OUT/gather" && cp /tmp/ab_gather/*.txt "$OUT/gather/" 2>/dev/null
grep -h "M=1024: rt" "$OUT"/gather/*.txt | head -4
