#!/usr/bin/env bash
# A/B/C/D of the grouped MLP: before (SiLU-and-mul kernel) vs the fused W13 epilogue variants
# v0 (cooperative, direct stores), v1 (cooperative, staged in shared memory), v2 (ping-pong 64x256).
set -u
source scripts/gpu/bundle_lib.sh
FINAL_OUT=${OUT:-/tmp/out}
OUT=/tmp/sv_out
start_device_script "$1" || exit 1
for v in 0 1; do
  timeout 100 "$B/cuda_kernels_test_v$v" --gtest_filter='*GroupedSm90*' > "$OUT/kt$v.log" 2>&1
  echo "v$v kernel test rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kt$v.log" | tr '\n' ' ')"
done
export MOESERVE_BENCH_PATHS=grouped MOESERVE_BENCH_FORMATS=bf16,mxfp8 MOESERVE_BENCH_LAYERS=seed,dsv3
for round in 1 2 3 4; do
  for b in before v0 v1; do
    bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
    MOESERVE_BENCH_TOKENS=512,1024 timeout 200 "$bin" 2>/dev/null | tail -n +2 |
      awk -F, -v f=$b -v r=$round '{print f","r","$0}' >> "$OUT/bench.csv"
  done
done
python3 - "$OUT/bench.csv" <<'PY'
import sys, statistics, collections
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 7: continue
    t[(f[2], f[3], f[4], f[5], f[0])].append(float(f[6]))
keys = sorted({k[:4] for k in t})
print("layer fmt tokens routing | before v0 v1 v2 (median of 3 rounds, us) | v0 v1 v2 / before")
for k in keys:
    m = [statistics.median(t[k + (b,)]) if t.get(k + (b,)) else float("nan") for b in ("before", "v0", "v1")]
    print(" ".join(k), "|", " ".join(f"{x:.0f}" for x in m), "|", " ".join(f"{x / m[0]:.3f}" for x in m[1:]))
PY
if command -v ncu > /dev/null; then
  for b in before v0 v1; do
    bin="$B/moe_experts_bench_$b"; [ $b = before ] && bin="$B/moe_experts_bench_before"
    MOESERVE_BENCH_FORMATS=bf16 MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_LAYERS=seed \
      MOESERVE_BENCH_ROUTING=balanced timeout 150 ncu --clock-control none --launch-skip 40 \
      --launch-count 8 --metrics gpu__time_duration.sum "$bin" > "$OUT/ncu_$b.txt" 2>&1
    python3 - "$OUT/ncu_$b.txt" "$b" <<'PY'
import re, sys
out, name = [], None
for line in open(sys.argv[1]):
    if "Context" in line and "Device" in line:
        m0 = re.search(r"(\w+)[<(]", line.replace("(anonymous", "(anon"))
        name = m0.group(1) if m0 else "?"
    m = re.search(r"gpu__time_duration.sum\s+(\w+)\s+([\d.,]+)", line)
    if m and name:
        v = float(m.group(2).replace(",", ""))
        out.append(f"{name}={v / 1000 if m.group(1) == 'nsecond' else v:.1f}")
print("ncu", sys.argv[2], " ".join(out))
PY
  done
fi
mkdir -p "$FINAL_OUT" && tar -C "$OUT" -czf "$FINAL_OUT/logs.tgz" .
