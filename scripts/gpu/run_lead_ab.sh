#!/usr/bin/env bash
# --lane_lead_us against issue 12's serving targets, for two builds in one device call: seed layer
# MXFP8, M=16. For each of a, a --lane_lead_us LEAD, b, b --lane_lead_us LEAD (ROUNDS alternating
# rounds, order reversed every other round): a fresh server, one caller (400 calls) and 8 callers
# (6400 calls); then a fresh server with --max_queue_wait_ms 0.5 and the open-loop overload
# (serve_lib.sh's overload: RATE calls/s, 10 s, 32 connections, answers checked, RSS sampled).
# Prints one line per run and a table last. Made for dc9c7a3 (the queue-wait bound stops
# crediting the lead): a = the build before it, b = it or later.
#   make_ab_bundle.sh A B .bundle/lead.tgz ab && run_lead_ab.sh .bundle/lead.tgz
# LEAD (default 120 us), RATE (default 24000 calls/s), ROUNDS (default 2), VARIANTS (default
# "a a_lead b b_lead"), CLIENTS (overload client processes, serve_lib.sh), MODEL (server flags
# in place of the seed layer's: a dry run on a CPU build).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_serving_script "$1" 50171 || exit 1
LEAD=${LEAD:-120}
RATE=${RATE:-24000}
row() { echo "   $1: $2"; }
# lead steps / steps so far (moeserve_batch_lead_steps_total / moeserve_batch_calls_count)
leads() {
  python3 - "$((PORT + 1))" <<'PY'
import sys, urllib.request
v = {}
try:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
except OSError:
    text = ""
for line in text.splitlines():
    if line.startswith(("moeserve_batch_lead_steps_total ", "moeserve_batch_calls_count ")):
        k, x = line.split()
        v[k] = int(float(x))
print(f"{v.get('moeserve_batch_lead_steps_total', '-')}/{v.get('moeserve_batch_calls_count', '-')}")
PY
}
SEED=${MODEL:-"--model seed-megamoe --num_experts 32 --num_layers 1 --weight_format mxfp8"}
table=$OUT/lead_table.txt
printf '%-3s %-10s %8s %8s %8s %7s %11s %8s %9s %9s %9s %9s %11s\n' r variant c1_per_s c8_per_s \
  x_c1 c8_p50 c8_leads unl_p99 answered ovl_p99 x_unl rss_peak ovl_leads > "$table"
cpu0=$(cpu_mark)
for r in $(seq "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  for v in $(round_order "$r" ${VARIANTS:-a a_lead b b_lead}); do
    side=${v%_lead}
    flags=""
    [ "$v" != "$side" ] && flags="--lane_lead_us $LEAD"
    ln -sf "$B/moeserve_$side" "$B/moeserve"
    t=${v}_$r
    # shellcheck disable=SC2086
    serve "$t" $SEED $flags
    load "${t}_c1" 16 1 400
    load "${t}_c8" 16 8 6400
    c8_leads=$(leads)
    stop
    # shellcheck disable=SC2086
    serve "${t}_bounded" $SEED --max_queue_wait_ms 0.5 $flags
    overload "${t}_ovl" "$RATE"
    ovl_leads=$(leads)
    stop
    ok=$(grep -o '^sent=[0-9]* ok=[0-9]*' "$OUT/load_${t}_ovl.log" | sed 's/.*ok=//')
    p99=$(grep -o 'latency_from_schedule_ms: p50=[0-9.]* p90=[0-9.]* p99=[0-9.]*' \
      "$OUT/load_${t}_ovl.log" | sed 's/.*p99=//')
    unl=$(val "${t}_c1" p99)
    # A client process that did not run (CLIENTS > 1) leaves an overload short of its rate.
    grep -q "did not run" "$OUT/load_${t}_ovl.log" && p99="short:$p99"
    printf '%-3s %-10s %8s %8s %8s %7s %11s %8s %9s %9s %9s %9s %11s\n' "$r" "$v" \
      "$(val "${t}_c1" requests_per_s)" "$(val "${t}_c8" requests_per_s)" \
      "$(ratio "$(val "${t}_c8" requests_per_s)" "$(val "${t}_c1" requests_per_s)")" \
      "$(val "${t}_c8" p50)" "$c8_leads" "$unl" "${ok:-0}" "${p99:-n/a}" \
      "$(ratio "${p99:-0}" "${unl:-0}")" "$(sort -n "$OUT/rss_${t}_ovl.txt" | tail -1)" \
      "$ovl_leads" >> "$table"
    echo "== $v round $r: s0 $(grep -o 'latency_ms_by_second_sent: s0:[^ ]*' "$OUT/load_${t}_ovl.log")"
  done
done
echo "host CPU over the runs: $(cpu_since "$cpu0")"
echo "lead=$LEAD us, overload rate=$RATE/s; ovl_p99: answered p99 from the schedule (ms), x_unl: over the unloaded p99;" \
  "*_leads: lead steps / steps of that server (moeserve_batch_lead_steps_total; '-' before the metric)"
cat "$table"
