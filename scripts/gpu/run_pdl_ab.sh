#!/usr/bin/env bash
# Programmatic dependent launch on and off (MOESERVE_PDL=0) in one build, one device call:
# the GPU suites (every GEMM tile, the graphs), then engine_forward_bench (trivial layer BF16 and
# seed MXFP8 at 1 and 16 tokens, timed) and moe_experts_bench's decode path (LAYERS, default
# seed; TOKENS, default 1,16,64), settings alternating, ROUNDS rounds (default 2), medians.
# Usage: run_pdl_ab.sh BUNDLE.tgz (bin/: engine_forward_bench, moe_experts_bench, the tests).
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
SANITIZERS=${SANITIZERS:-} gpu_suites '*DecodePair*'
CSV=$OUT/engine_pdl.csv
for round in $(seq "${ROUNDS:-2}"); do for pdl in 0 1; do
  engine_bench_rows pdl=$pdl "$CSV" 1,16 600 env MOESERVE_PDL=$pdl
done; done
echo "== engine_forward_bench, medians: model tokens pdl -> wall p50 us, experts stage us"
engine_summary "$CSV"
echo "== moe_experts_bench decode path, MOESERVE_PDL=0 against the default (on)"
LAYERS=${LAYERS:-seed} TOKENS=${TOKENS:-1,16,64} decode_ab MOESERVE_PDL "$OUT/decode_pdl.csv" 0 default
