#!/bin/bash
# One device call: the W8A8 grouped path's tile rows (MOESERVE_BENCH_GROUPED_TILE=64 / 128 / the
# rule's choice) at 64-1024 tokens, and the MXFP8 decode kernels' warpgroup-MMA threshold
# (MOESERVE_BENCH_WGMMA_FROM) at 32-64 tokens, alternating, ROUNDS rounds; medians per setting.
# moe_experts_bench and its libraries unpacked in .b/ (bin/, lib/).
B=.b/bin; export LD_LIBRARY_PATH=$PWD/.b/lib; O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
common="MOESERVE_BENCH_FORMATS=mxfp8 MOESERVE_BENCH_ROUTING=balanced,hot,random"
for r in $(seq 1 ${ROUNDS:-2}); do
  for t in 64 128 rule; do
    tile=; [ $t != rule ] && tile="MOESERVE_BENCH_GROUPED_TILE=$t"
    env $common $tile MOESERVE_BENCH_PATHS=w8a8 MOESERVE_BENCH_TOKENS=${TOKENS:-64,128,256,384,512,1024} \
      $B/moe_experts_bench | grep -v '^layer' | sed "s/^/tile=$t,/" >> "$O/ab.csv"
  done
  for w in 16 32 rule; do
    wg=; [ $w != rule ] && wg="MOESERVE_BENCH_WGMMA_FROM=$w"
    env $common $wg MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_TOKENS=32,64 \
      $B/moe_experts_bench | grep -v '^layer' | sed "s/^/wgmma=$w,/" >> "$O/ab.csv"
  done
done
python3 - "$O/ab.csv" <<'PY'
import csv, sys, statistics, collections
d = collections.defaultdict(list)
for row in csv.reader(open(sys.argv[1])):
    setting, layer, fmt, tokens, routing, us = row[0], row[1], row[2], int(row[3]), row[4], float(row[5])
    d[(row[8], layer, tokens, routing, setting)].append(us)
keys = sorted({k[:4] for k in d})
for path, layer, tokens, routing in keys:
    cells = [f"{s}: {statistics.median(d[(path, layer, tokens, routing, s)]):.1f}"
             for s in sorted({k[4] for k in d if k[:4] == (path, layer, tokens, routing)})]
    print(f"{path} {layer} {tokens} {routing} | " + " | ".join(cells))
PY
