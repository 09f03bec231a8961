#!/usr/bin/env bash
# Builds of the MXFP8 decode GEMMs A/B'd in one device call: bin/moe_experts_bench_<s> for s in
# SETS (default "a b") alternate (ROUNDS rounds, default 2) on the decode path (LAYERS, default
# seed,dsv3; TOKENS, default 1,16,32,48,64,96,128; balanced / hot / random routing), and the
# summary gives each build's median us, share of the floor and ratio to the first. Then Nsight
# Compute's stall reasons for each build's seed W13 launch at 64 tokens, balanced (the narrow
# tile) and random (the adaptive tile). If the bundle has the GPU test binaries (the last
# build's), they run first, with racecheck on the decode-tile kernel tests.
# Usage: run_decode_build_ab.sh BUNDLE.tgz.
set -u
source "$(dirname "$0")/bundle_lib.sh"
start_device_script "$1" || exit 1
SETS=${SETS:-a b}
[ -x "$B/cuda_kernels_test" ] && gpu_suites '*BitForBit*:*SplitK*:*DecodeWgmma*'
TOKENS=${TOKENS:-1,16,32,48,64,96,128} decode_bench_env
CSV=$OUT/build_ab.csv
for round in $(seq "${ROUNDS:-2}"); do for set in $SETS; do
  timeout 150 "$B/moe_experts_bench_$set" 2>/dev/null | tail -n +2 |
    awk -F, -v s="$set" '{print s","$0}' >> "$CSV"
done; done
decode_summary "$CSV" $SETS
export MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_TOKENS=64
for set in $SETS; do for routing in balanced random; do
  # Launch order per iteration: narrow W13, adaptive W13, narrow W2, adaptive W2.
  skip=16; [ $routing = random ] && skip=17
  MOESERVE_BENCH_ROUTING=$routing timeout 120 ncu --clock-control none -k regex:MoeGemmKernel \
    --launch-skip $skip -c 1 --section SpeedOfLight --section WarpStateStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    "$B/moe_experts_bench_$set" > "$OUT/ncu_${set}_$routing.txt" 2>&1
  echo "== build $set $routing rc=$? $(grep -E 'Duration|Executed Ipc A' "$OUT/ncu_${set}_$routing.txt" | tr -s ' ' | tr '\n' ' ')"
  grep -E "issue_stalled" "$OUT/ncu_${set}_$routing.txt" | awk '$NF+0 > 0.2 {print "   ", $1, $NF}' |
    sed 's/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//' | sort -k2,2nr | head -8
done; done
