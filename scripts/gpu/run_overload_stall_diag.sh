#!/usr/bin/env bash
# What stalls every caller of issue 12's overload for 50-150 ms at once (one H100 host,
# 2026-12-06: four client processes saw p99 98-109 ms in second 1 and 40-62 ms in second 3, 4-6
# ms in the other eight; the server's own total stayed under 4 ms at p99, and its RSS grew
# ~200 MB in those seconds). Bundle BUNDLE.tgz (make_ab_bundle.sh: moeserve_b); ROUNDS fresh
# bounded servers (--max_queue_wait_ms 0.5, SERVE_FLAGS added), each loaded by CLIENTS (4)
# processes at RATE (23400) calls/s for 10 s while the host is sampled every 50 ms: the
# server's RSS, threads, CPU and metrics (overload_sampler.py), the kernel's TCP memory
# (/proc/net/sockstat, pages; /proc/sys/net/ipv4/tcp_mem the limits), pressure stall
# information (/proc/pressure) and the host's CPU. Prints per-second client latencies and the
# samples around the worst second.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50181 || exit 1
row() { echo "   $1: $2"; }
ln -sf "$B/moeserve_b" "$B/moeserve"
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
echo "tcp_mem (pages): $(cat /proc/sys/net/ipv4/tcp_mem); rmem_max $(cat /proc/sys/net/core/rmem_max)" \
  "tcp_rmem $(cat /proc/sys/net/ipv4/tcp_rmem) tcp_wmem $(cat /proc/sys/net/ipv4/tcp_wmem)"
host_sampler() {  # t_ms tcp_mem_pages tcp_inuse psi_cpu_some10 psi_mem_some10 psi_io_some10 busy%
  local t0 prev cur
  t0=$(date +%s%N)
  prev=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $5 + $6 }' /proc/stat)
  while :; do
    sleep 0.05
    cur=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $5 + $6 }' /proc/stat)
    echo "$(( ($(date +%s%N) - t0) / 1000000 )) $(awk '/^TCP:/ { for (i = 1; i <= NF; i++) if ($i == "mem") m = $(i + 1); else if ($i == "inuse") u = $(i + 1); print m, u }' /proc/net/sockstat)" \
      "$(for r in cpu memory io; do awk -F'avg10=' '/^some/ { split($2, a, " "); printf "%s ", a[1] }' /proc/pressure/$r 2>/dev/null || printf 'n/a '; done)" \
      "$(echo "$prev $cur" | awk '{ b = $3 - $1; i = $4 - $2; if (b + i > 0) printf "%.0f", 100 * b / (b + i); else print 0 }')"
    prev=$cur
  done
}
# CASES: '|'-separated "NAME TARGET [SERVER FLAGS]" (TARGET "-": 127.0.0.1:$PORT), one round
# each (in place of ROUNDS of the default case).
if [ -n "${CASES:-}" ]; then IFS='|' read -r -a cases <<< "$CASES"; else
  cases=(); for r in $(seq "${ROUNDS:-2}"); do cases+=("r$r - "); done; fi
names=()
for c in "${cases[@]}"; do
  read -r t target flags <<< "$c"
  names+=("$t")
  [ "$target" = - ] && target=127.0.0.1:$PORT
  # shellcheck disable=SC2086
  serve "$t" $SEED --max_queue_wait_ms 0.5 ${SERVE_FLAGS:-} $flags
  python3 scripts/gpu/overload_sampler.py "$SERVER_PID" "http://127.0.0.1:$((PORT + 1))/metrics" 13 0.05 \
    > "$OUT/sampler_$t.txt" 2>&1 &
  sp=$!
  host_sampler > "$OUT/host_$t.txt" 2>&1 &
  hp=$!
  TARGET=$target CLIENTS=${CLIENTS:-4} overload "${t}_ovl" "${RATE:-23400}"
  kill $hp 2>/dev/null
  wait $sp 2>/dev/null
  # The unloaded p99 on the same (now warm) server: one caller, 400 calls over TCP.
  load "${t}_c1" 16 1 400 > /dev/null
  stop
  for f in "$OUT"/load_${t}_ovl.[0-9]*.log; do
    echo "   $(basename "$f"): $(grep -o 'latency_ms_by_second_sent: .*' "$f" | sed 's/,max=[0-9.]*//g' | cut -c1-400)"
  done
done
echo "host samples (t_ms tcp_mem_pages tcp_inuse psi_cpu psi_mem psi_io busy%) and server samples: $OUT/host_*.txt, sampler_*.txt"
for t in "${names[@]}"; do
  echo "== $t: $(grep -E '^sent=' "$OUT/load_${t}_ovl.log") $(grep -E '^latency_ms:' "$OUT/load_${t}_ovl.log")"
  p99=$(grep -o 'latency_from_schedule_ms: p50=[0-9.]* p90=[0-9.]* p99=[0-9.]*' "$OUT/load_${t}_ovl.log" | sed 's/.*p99=//')
  echo "   answered p99 from the schedule $p99 ms, unloaded p99 $(val "${t}_c1" p99) ms: x$(ratio "$p99" "$(val "${t}_c1" p99)")"
  echo "   host samples over 65 ms apart (t_ms tcp_mem_pages ... busy%): $(awk 'NR > 1 && $1 - p > 65 { printf "%s(+%d) ", $1, $1 - p } { p = $1 }' "$OUT/host_$t.txt")"
  echo "   largest TCP memory samples: $(sort -k2 -n -r "$OUT/host_$t.txt" | head -6 | awk '{ printf "%s@%sms ", $2, $1 }')"
  grep -E "throttl|nr_" "$OUT/sampler_$t.txt" | head -3
done
