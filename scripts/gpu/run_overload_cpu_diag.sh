#!/bin/bash
# Where issue 12's overload tail comes from on the host: the open loop of run_scheduler_ab.sh
# (seed layer MXFP8, M=16, 32 connections, 10 s, --max_queue_wait_ms 0.5) on a fresh server
# ("a" or "b" of $BUNDLE, default .bundle/ab.tgz), then its unloaded p99 (one caller, 400
# calls), with the host's CPU use (all cores busy %, the server's and the client's CPU seconds,
# their thread counts) and with the client and server pinned to separate cores.
# CASES: '|'-separated "RATE CLIENT_CPUS SERVER_CPUS SIDE [SERVER FLAGS] [:: LOAD FLAGS]" (CPUS
# "-": unpinned; LOAD FLAGS go to every moeserve-cli load of the case). CLI: another
# moeserve-cli (default the bundle's). REPEAT=2 runs each overload a second time on the same
# (then warm) server.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/serve_lib.sh
use_tgz_bundle "${BUNDLE:-.bundle/ab.tgz}" ab || exit 1
B=/tmp/diagb && mkdir -p $B && cp "${CLI:-$BUNDLE_BIN/moeserve-cli}" $B/moeserve-cli &&
  cp $BUNDLE_BIN/moeserve_a $BUNDLE_BIN/moeserve_b $B/
SEED="--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"
nproc; date -u
busy() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $5 + $6 }' /proc/stat; }
cpu_s() { awk '{ print ($14 + $15) / 100 }' "/proc/$1/stat"; }
IFS='|' read -r -a cases <<< "${CASES:-21000 - - a|21000 - - b|21000 0-3 4-15 b|14000 - - b}"
i=0
for c in "${cases[@]}"; do
  i=$((i + 1))
  read -r rate ccpus scpus side flags <<< "$c"
  lflags=""
  if [[ "$flags" == *"::"* ]]; then
    lflags=${flags#*::}
    flags=${flags%%::*}
  fi
  pre_s=""; pre_c=""
  [ "$scpus" != - ] && pre_s="taskset -c $scpus"
  [ "$ccpus" != - ] && pre_c="taskset -c $ccpus"
  printf '#!/bin/bash\nexec %s /tmp/diagb/moeserve_%s "$@"\n' "$pre_s" "$side" > $B/moeserve && chmod +x $B/moeserve
  t=d$i
  # shellcheck disable=SC2086
  serve $t $SEED --max_queue_wait_ms 0.5 ${flags:-}
  read -r b0 i0 < <(busy); s0=$(cpu_s $SERVER_PID)
  # shellcheck disable=SC2086
  timeout 120 $pre_c $B/moeserve-cli load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
    --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 $lflags \
    > "$OUT/ovl_$t.log" 2>&1 &
  cli=$!
  sleep 5
  # $cli is the timeout wrapper: count the threads of the moeserve-cli it runs.
  sth=$(ls /proc/$SERVER_PID/task | wc -l)
  cth=$(ls "/proc/$(pgrep -n -f 'moeserve-cli load')/task" 2>/dev/null | wc -l)
  top -b -n 1 -H -w 200 2>/dev/null | head -40 > "$OUT/top_$t.txt"
  c5=$(cpu_s "$(pgrep -n -f 'moeserve-cli load')")
  wait $cli
  read -r b1 i1 < <(busy); s1=$(cpu_s $SERVER_PID)
  # REPEAT=2: the same overload again on the now warm server (every step size seen).
  for again in $(seq 2 "${REPEAT:-1}"); do
    # shellcheck disable=SC2086
    timeout 120 $pre_c $B/moeserve-cli load --target 127.0.0.1:$PORT --tokens 16 --rate "$rate" \
      --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 $lflags \
      > "$OUT/ovl_${t}_$again.log" 2>&1
    echo "   again ($again): $(grep -E '^latency_ms:' "$OUT/ovl_${t}_$again.log")" \
      "$(grep -E '^sent=' "$OUT/ovl_${t}_$again.log")"
    grep -E "^latency_ms_by" "$OUT/ovl_${t}_$again.log" | cut -c1-400
  done
  load ${t}_c1 16 1 400 > /dev/null
  grep -E "calibrated|warmed" "$OUT/server_$t.log"
  stop
  p99u=$(val ${t}_c1 p99)
  p99o=$(grep -o 'p99=[0-9.]*' "$OUT/ovl_$t.log" | head -1 | cut -d= -f2)
  echo "== [$c] p99 $p99o ms = x$(ratio "$p99o" "$p99u") the unloaded $p99u;" \
    "host busy $(awk -v b=$((b1 - b0)) -v i=$((i1 - i0)) 'BEGIN { printf "%.0f%%", 100 * b / (b + i) }');" \
    "server cpu $(awk -v a="$s0" -v b="$s1" 'BEGIN { printf "%.1f", b - a }') s ($sth threads);" \
    "client cpu at 5 s $c5 s ($cth threads); $(grep -E '^sent=' "$OUT/ovl_$t.log")"
  grep -E "^latency_ms|^latency_from_schedule|^send_lag|^server_total" "$OUT/ovl_$t.log" |
    cut -c1-400
done
