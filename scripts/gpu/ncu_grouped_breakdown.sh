#!/usr/bin/env bash
# One device call: where a grouped (prefill-sized) BF16 MLP's time goes, kernel by kernel, in
# Nsight Compute (durations of one MLP's launches after warm-ups), for the 1024-token rows of
# issue 13 (DSV3 balanced and hot, seed hot), then MoeAlignKernel's warp stalls at 8192 routes.
# Usage: ncu_grouped_breakdown.sh BUNDLE.tgz (bin/moe_experts_bench). Writes under $OUT.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# ROWS (layer:routing ...), TILE (MOESERVE_BENCH_GROUPED_TILE: 64 = both GEMMs in 64x256
# ping-pong tiles), NO_ALIGN=1: skip the align stall profile.
for row in ${ROWS:-dsv3:balanced dsv3:hot seed:hot}; do
  layer=${row%%:*} routing=${row##*:}
  ${TILE:+env MOESERVE_BENCH_GROUPED_TILE=$TILE} MOESERVE_BENCH_LAYERS=$layer MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_FORMATS=bf16 \
    MOESERVE_BENCH_ROUTING=$routing MOESERVE_BENCH_PATHS=grouped \
    timeout 150 "$NCU" --clock-control none --launch-skip 24 -c 12 \
    --metrics gpu__time_duration.sum,dram__bytes.sum "$B/moe_experts_bench" \
    > "$OUT/ncu_${layer}_${routing}.txt" 2>&1
  echo "== $layer $routing rc=$? (kernel, us, DRAM MB)"
  python3 - "$OUT/ncu_${layer}_${routing}.txt" <<'PY'
import re, sys
name = None
rows = []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s+(\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if m:
        name = m.group(1)
        if "cutlass" in name:
            k = re.search(r"KernelPtrArray\w+", name)
            name = "cutlass " + (k.group(0) if k else "gemm")
        else:
            name = re.sub(r"\(.*", "", name).split("::")[-1]
        rows.append([name, None, None])
        continue
    m = re.match(r"\s+gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
    if m and rows:
        unit, v = m.group(1), float(m.group(2).replace(",", ""))
        rows[-1][1] = v / 1000 if unit == "nsecond" else v * 1000 if unit == "msecond" else v
    m = re.match(r"\s+dram__bytes.sum\s+(\S+)\s+([\d.,]+)", line)
    if m and rows:
        unit, v = m.group(1), float(m.group(2).replace(",", ""))
        scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1, "Gbyte": 1e3}.get(unit, float("nan"))
        rows[-1][2] = v * scale
for n, t, b in rows:
    print(f"  {n:60s} {t if t is not None else float('nan'):9.1f} {b if b is not None else float('nan'):9.1f}")
PY
done
[ -n "${NO_ALIGN:-}" ] && exit 0
MOESERVE_BENCH_LAYERS=dsv3 MOESERVE_BENCH_TOKENS=1024 MOESERVE_BENCH_FORMATS=bf16 \
  MOESERVE_BENCH_ROUTING=balanced MOESERVE_BENCH_PATHS=grouped \
  timeout 150 "$NCU" --clock-control none -k regex:MoeAlign --launch-skip 3 -c 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio "$B/moe_experts_bench" > "$OUT/ncu_align.txt" 2>&1
echo "== MoeAlignKernel, 8192 routes, 32 experts rc=$?"
grep -E "Duration|Warp Cycles Per Issued|stalled|Issue Slots Busy|Block Size|Grid Size|Registers|Theoretical Occ|Achieved Occ|One or More" \
  "$OUT/ncu_align.txt" | awk '$NF+0 > 0.05 || !/stalled/' | cut -c1-110 | head -45
