#!/usr/bin/env bash
# Stall reasons (per issued instruction) and the SASS source page (per-instruction samples) of one
# seed W13 wgmma launch at 256 tokens. Run after a script that unpacked the bundle (SA_READY).

source scripts/gpu/bundle_lib.sh; SA_READY=1 unpack_bundle x
MOESERVE_BENCH_FORMATS=mxfp8 MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_TOKENS=256 MOESERVE_BENCH_LAYERS=seed MOESERVE_BENCH_ROUTING=balanced \
  timeout 200 ncu --clock-control none --kernel-name regex:MoeGemmWgmma --launch-skip 10 --launch-count 1 \
  --section WarpStateStats --section SourceCounters --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
  -o $OUT/rep "$B/moe_experts_bench" > $OUT/ncu_rep.log 2>&1
ncu -i $OUT/rep.ncu-rep --page raw --csv 2>&1 | python3 -c "
import sys,csv
rows=list(csv.reader(sys.stdin))
h=rows[0]; v=rows[2] if len(rows)>2 else rows[1]
for a,b in zip(h,v):
  if 'stalled' in a and 'per_issue_active' in a:
    try:
      if float(b)>0.05: print(a.replace('smsp__average_warps_issue_stalled_',''),b)
    except: pass
"
ncu -i $OUT/rep.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1; echo "sass rc=$? $(wc -l < $OUT/sass.csv)"
