#!/usr/bin/env bash
# Session 37's device call. (1) The one-token layer's expert kernels under split-K bounds:
# moe_experts_bench's decode path (align + W13 + W2) on the trivial layer (BF16, H7168 I64, 16
# experts, top-4, M = 1, 4, 16) and Qwen3's shape (32 experts, top-8, M = 1, 16) for each
# MOESERVE_SPLIT_K setting, two rounds; then, for the default and the fastest one-token setting,
# engine_forward_bench (trivial, M=1, timed and untimed) and Nsight Compute's kernel durations of
# one graphed step. (2) Issue 12's overload (20,000 calls/s, M=16, 32 connections, 10 s, seed
# MXFP8, --max_queue_wait_ms 0.5) on a (before the backlog fix) and b, b with the old decode
# rule (--inline_request_bytes -1), with the server sampled every 0.1 s (RSS, threads, CPU,
# in-flight requests, queued tokens, buffer pool, refusals; overload_sampler.py).
# Usage: run_s37_probe.sh BUNDLE.tgz   (make_ab_bundle.sh A B; bin/moe_experts_bench added)
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" || exit 1
ROOT=$OUT
t0=$(date +%s)
echo "host: $(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg), cgroup cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo -)," \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
if [ -z "${SKIP_SPLIT:-}" ]; then
SETS=${SETS:-"default nosplit 2,16,1 4,28,1 2,32,1 4,16,2 2,32,2 1,64,2"}
csv=$ROOT/split.csv
: > "$csv"
for round in 1 2; do for set in $(round_order $round $SETS); do
  case $set in default) x=() ;; nosplit) x=(MOESERVE_BENCH_SPLIT_K=0) ;; *) x=(MOESERVE_SPLIT_K=$set) ;; esac
  for shape in trivial qwen3; do
    if [ $shape = trivial ]; then e=(MOESERVE_BENCH_EXPERTS=16 MOESERVE_BENCH_TOPK=4 MOESERVE_BENCH_TOKENS=1,4,16 MOESERVE_BENCH_FORMATS=bf16)
    else e=(MOESERVE_BENCH_TOKENS=1,16 MOESERVE_BENCH_FORMATS=bf16,mxfp8); fi
    env MOESERVE_BENCH_PATHS=decode MOESERVE_BENCH_LAYERS=$shape MOESERVE_BENCH_ROUTING=balanced \
      "${e[@]}" "${x[@]}" timeout 60 "$B/moe_experts_bench" 2>/dev/null | tail -n +2 |
      awk -v s="$set" '{print s","$0}' >> "$csv"
  done
done; done
best=$(python3 - "$csv" <<'PY'
import sys, collections, statistics
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 6: continue
    t[(f[1] + "-" + f[2], int(f[3]), f[0])].append(float(f[5]))
keys = sorted({k[:2] for k in t})
sets = sorted({k[2] for k in t}, key=lambda s: (s != "default", s))
print("layer tokens | " + " | ".join(sets), file=sys.stderr)
for k in keys:
    base = statistics.median(t[k + ("default",)])
    print(*k, "| " + " | ".join(f"{statistics.median(t[k + (s,)]):.1f}" for s in sets), file=sys.stderr)
one = {s: statistics.median(t[("trivial-bf16", 1, s)]) for s in sets}
print(min(one, key=one.get))
PY
)
echo "fastest one-token setting: $best"
echo "split $(( $(date +%s) - t0 )) s"
for round in 1 2; do for set in $(round_order $round default "$best"); do
  x=(); [ "$set" != default ] && x=(MOESERVE_SPLIT_K=$set)
  [ "$set" = nosplit ] && continue
  for timed in 1 0; do
    echo "engine $set timed=$timed: $(env "${x[@]}" timeout 60 "$B/engine_forward_bench_b" --model trivial \
      --weight_format bf16 --tokens 1,16 --iters 400 --timed $timed | grep -v '^#\|^tokens' | cut -d, -f1-7 | tr '\n' ' ')"
  done
done; done
for set in default "$best"; do
  x=(); [ "$set" != default ] && x=(MOESERVE_SPLIT_K=$set)
  env "${x[@]}" timeout 120 ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum \
    "$B/engine_forward_bench_b" --model trivial --weight_format bf16 --tokens 1 --iters 3 --timed 0 \
    > "$ROOT/ncu_$set.csv" 2>&1
  echo "== ncu $set trivial M=1 rc=$?: the last step's kernels (us)"
  ncu_last_kernels "$ROOT/ncu_$set.csv" 7
done
echo "kernels $(( $(date +%s) - t0 )) s"
fi
# (2) The overload, sampled.
source scripts/gpu/serve_lib.sh
PORT=50171
OB=/tmp/ob && mkdir -p $OB && cp "$B/moeserve-cli" $OB/
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
OUT=$ROOT/ovl && mkdir -p "$OUT"
row() { :; }
i=0
IFS='|' read -r -a cases <<< "${CASES:-a|b|b --inline_request_bytes -1|b}"
for c in "${cases[@]}"; do
  i=$((i + 1))
  read -r side flags <<< "$c"
  B0=$B; cp "$B/moeserve_$side" $OB/moeserve; B=$OB
  # shellcheck disable=SC2086
  serve o$i $SEED --max_queue_wait_ms 0.5 ${flags:-}
  python3 scripts/gpu/overload_sampler.py $SERVER_PID http://127.0.0.1:$((PORT + 1))/metrics 13 ${SAMPLE_PERIOD:-0.1} \
    > "$OUT/sample_o$i.txt" 2>&1 &
  sp=$!
  timeout 60 $B/moeserve-cli load --target 127.0.0.1:$PORT --tokens 16 --rate ${RATE:-20000} \
    --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 > "$OUT/ovl_o$i.log" 2>&1
  wait $sp
  load o${i}_c1 16 1 400
  stop
  B=$B0
  echo "== overload [$c]: unloaded p99 $(val o${i}_c1 p99) ms; $(grep -E '^sent=' "$OUT/ovl_o$i.log")"
  grep -E "^latency_ms|^latency_from_schedule|^send_lag|^server_total|^server_stages_us_p99" "$OUT/ovl_o$i.log" | cut -c1-300
  grep -E "^latency_ms_by" "$OUT/ovl_o$i.log" | tr ' ' '\n' | sed -n '2,5p' | tr '\n' ' '; echo
  echo "   samples (t rss_mb threads cpu_s inflight queued pool_mb refused requests), every 0.5 s:"
  awk 'NR == 1 || NR % 5 == 2' "$OUT/sample_o$i.txt" | grep -v '^#' | head -${SAMPLE_ROWS:-30} | sed 's/^/   /'
  grep '^#' "$OUT/sample_o$i.txt" | sed 's/^/   /'
done
echo "total $(( $(date +%s) - t0 )) s"
# The most splits asked for, on the CUDA experts suite (a shard) and the kernels' tests.
[ -n "${SKIP_SPLIT:-}" ] && exit 0
for t in cuda_kernels_test cuda_experts_test; do
  MOESERVE_SPLIT_K=1,64,2 GTEST_TOTAL_SHARDS=$([ $t = cuda_experts_test ] && echo 4 || echo 1) \
    GTEST_SHARD_INDEX=0 run_gtest $t 300
done
echo "total $(( $(date +%s) - t0 )) s"
