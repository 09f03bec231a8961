#!/usr/bin/env bash
# Random routing (every token's top-8 drawn uniformly): moeserve (both paths) against PyTorch's
# peers, and the grouped GEMMs' tile rows forced both ways.
set -u
source scripts/gpu/bundle_lib.sh
FINAL_OUT=${OUT:-}
OUT=/tmp/rnd_out
start_device_script "$1" || exit 1
mkdir -p "$OUT/py"
export MOESERVE_BENCH_ROUTING=random
for round in 1 2; do for tile in 128 64; do
  MOESERVE_BENCH_GROUPED_TILE=$tile MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 \
    MOESERVE_BENCH_TOKENS=520,1024,1280,2048 timeout 100 "$B/moe_experts_bench" 2>/dev/null |
    tail -n +2 | awk -F, -v t=$tile '{print t","$0}' >> "$OUT/tile.csv"
done; done
python3 - "$OUT/tile.csv" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    t[(f[1], int(f[3]), f[0])].append(float(f[5]))
for k in sorted({k[:2] for k in t}):
    a = statistics.median(t[k + ("128",)]); b = statistics.median(t[k + ("64",)])
    print("tile rows, random:", *k, f"128-row {a:.0f} us, 64-row {b:.0f} us, 64/128 {b/a:.3f}")
PY
MOESERVE_BENCH_TOKENS=64,256,520,1024 timeout 300 python3 scripts/gpu/bench_moe.py "$B/moe_experts_bench" "$OUT/py" > "$OUT/py.log" 2>&1
echo "bench_moe rc=$?"
grep -E '^\| (seed|dsv3) |^crossover' "$OUT/py.log"
cp "$OUT/py.log" "$OUT/tile.csv" "${FINAL_OUT:-/nonexistent}" 2>/dev/null; true
