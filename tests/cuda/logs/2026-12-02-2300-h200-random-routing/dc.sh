#!/usr/bin/env bash
# The grouped GEMMs' tile rows chosen on the device from the counts (after) against the choice
# by the average on the host (before, 35886f9): kernel and experts tests, then the raw bench,
# grouped path, BF16, three routings, alternating, two rounds.
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/dc_out
start_device_script "$1" || exit 1
timeout 100 "$B/cuda_kernels_test" > "$OUT/kt.log" 2>&1
echo "cuda_kernels_test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kt.log" | tr '\n' ' ')"
grep -A5 'Failure' "$OUT/kt.log" | head -20
timeout 300 "$B/cuda_experts_test" > "$OUT/et.log" 2>&1
echo "cuda_experts_test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/et.log" | tr '\n' ' ')"
export MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_LAYERS=seed,dsv3 \
  MOESERVE_BENCH_ROUTING=balanced,hot,random
for round in 1 2; do for b in before after; do
  bin="$B/moe_experts_bench"; [ $b = before ] && bin="$B/moe_experts_bench_before"
  MOESERVE_BENCH_TOKENS=256,520,1024,1280,2048 timeout 150 "$bin" 2>/dev/null | tail -n +2 |
    awk -F, -v b=$b '{print b","$0}' >> "$OUT/dc.csv"
done; done
python3 - "$OUT/dc.csv" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    t[(f[1], int(f[3]), f[4], f[0])].append(float(f[5]))
for k in sorted({k[:3] for k in t}, key=lambda k: (k[0], k[2], k[1])):
    a = statistics.median(t[k + ("before",)]); b = statistics.median(t[k + ("after",)])
    print("dc", *k, f"before {a:.0f} after {b:.0f} ratio {b/a:.3f}")
PY
