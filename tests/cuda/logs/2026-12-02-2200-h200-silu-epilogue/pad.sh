#!/usr/bin/env bash
# Experiment: do partial 128-row tiles cause the grouped W13's extra DRAM reads? The grouped
# GEMMs see each expert's count rounded up to 128 (MOESERVE_BENCH_PAD_COUNTS=128; outputs wrong,
# timing only), unfused (bench_u) and with the SiLU-and-mul epilogue (bench_f, staged stores).
set -u
source scripts/gpu/bundle_lib.sh
OUT=/tmp/pad_out
start_device_script "$1" || exit 1
export MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_LAYERS=seed,dsv3 MOESERVE_BENCH_GROUPED_TILE=128
for round in 1 2; do for b in u f; do for pad in 0 128; do
  MOESERVE_BENCH_PAD_COUNTS=$pad MOESERVE_BENCH_TOKENS=1000,1024,1040 timeout 100 "$B/bench_$b" 2>/dev/null |
    tail -n +2 | awk -F, -v b=$b -v p=$pad '{print b","p","$0}' >> "$OUT/pad.csv"
done; done; done
python3 - "$OUT/pad.csv" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    t[(f[2], int(f[4]), f[5], f[0], f[1])].append(float(f[6]))
print("layer tokens routing | unfused | unfused pad128 | fused | fused pad128 (us)")
for k in sorted({k[:3] for k in t}):
    print(*k, "|", " | ".join(f"{statistics.median(t[k + v]):.0f}" for v in [("u","0"),("u","128"),("f","0"),("f","128")]))
PY
for v in "u 0" "u 128" "f 128"; do set -- $v
  MOESERVE_BENCH_PAD_COUNTS=$2 MOESERVE_BENCH_TOKENS=1040 MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_ROUTING=hot \
    timeout 100 ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 10 --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum "$B/bench_$1" > "$OUT/n.txt" 2>&1
  echo "ncu W13 seed 1040 hot bench_$1 pad $2: $(grep -E 'gpu__time|dram' "$OUT/n.txt" | awk '{printf "%s=%s%s ", $1, $3, $2}')"
done
true
