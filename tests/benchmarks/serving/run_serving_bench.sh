#!/bin/bash
# The serving benchmark (issue 12), one device call on one H200: what callers see through the C++
# client (moeserve-cli load) when several of them share a server.
#   - seed per-rank layer (32 experts, top-8, H3072 I5120), MXFP8 and BF16 weights:
#     1 caller vs 8 concurrent callers at M=16 (unary and ForwardStream; 6400 calls: 3200 read
#     ratios 0.3-0.5 apart between rounds on one host), 1 vs 2 callers at
#     M=1024 with 2 steps in flight (the default on a GPU) and with 1 (no overlap);
#   - trivial experts (I=64, H7168): the server's own cost of a 1-token call;
#   - an open-loop overload run at 2x the capacity (32 closed-loop callers at M=16, measured on
#     the server without a queue bound, which would refuse some of them) for 10 s on a server
#     with OVERLOAD_FLAGS (default --max_queue_wait_ms 0.5 --max_batch_tokens 256: a bounded
#     queue and steps of at most 16 such calls, a deployment's latency settings), sent by
#     CLIENTS (default 4) client processes (one could not keep to its schedule on H100 hosts):
#     every call must answer correctly (checked against its unloaded answer) or be refused
#     RESOURCE_EXHAUSTED; answered p99 against the unloaded p99; server RSS sampled throughout.
# Usage: run_serving_bench.sh [BIN_DIR]   (moeserve, moeserve-cli; LD_LIBRARY_PATH set)
#   WFS="mxfp8" for one weight format (default "mxfp8 bf16"). The overload's open loop spreads
#   its calls over 32 connections, like the 32 closed-loop callers that measured the capacity.
#   SKIP_OVERLOAD=1: no overload run (nor the 32-caller capacity it needs); SKIP_1LANE=1: no
#   server with one step in flight; SERVE_EXTRA: flags for every server (an A/B of a flag).
set -uo pipefail
B=${1:-build/bin}
OUT=${OUT:-/tmp/serving}; mkdir -p "$OUT"
PORT=50151
SEED=${SEED:-"--model seed-megamoe --num_experts 32 --num_layers 1"}  # (smaller for a CPU dry run)
TRIVIAL="--model tiny --hidden 7168 --intermediate 64 --num_experts 16 --topk 4 --num_layers 1"
declare -a ROWS
row() { ROWS+=("$(printf '%-46s %s' "$1" "$2")"); echo "== $1: $2"; }
source "$(dirname "$0")/../../../scripts/gpu/serve_lib.sh"

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; date -u
echo "host: $(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg),$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
cpu0=$(cpu_mark)
for wf in ${WFS:-mxfp8 bf16}; do
  serve seed_$wf $SEED --weight_format $wf
  load "${wf}_M16_c1" 16 1 400
  load "${wf}_M16_c8" 16 8 6400
  load "${wf}_M16_c8_stream" 16 8 6400 --stream
  load "${wf}_M1024_c1" 1024 1 80
  load "${wf}_M1024_c2" 1024 2 160
  [ $wf = mxfp8 ] && [ -z "${SKIP_OVERLOAD:-}" ] && load "${wf}_M16_c32" 16 32 8000
  stop
  if [ $wf = mxfp8 ] && [ -z "${SKIP_OVERLOAD:-}" ]; then
    oflags=${OVERLOAD_FLAGS:---max_queue_wait_ms 0.5 --max_batch_tokens 256}
    # shellcheck disable=SC2086
    serve seed_${wf}_bounded $SEED --weight_format $wf $oflags
    # Overload: 2x the 32-caller capacity (measured without a bound).
    cap=$(val mxfp8_M16_c32 requests_per_s)
    CLIENTS=${CLIENTS:-4} overload overload "$(awk -v c="$cap" 'BEGIN { printf "%.0f", 2 * c }')"
    stop
  fi
  [ -n "${SKIP_1LANE:-}" ] && continue
  serve seed_${wf}_1lane $SEED --weight_format $wf --steps_in_flight 1
  load "${wf}_M16_c8_1lane" 16 8 6400
  load "${wf}_M1024_c1_1lane" 1024 1 80
  load "${wf}_M1024_c2_1lane" 1024 2 160
  stop
done
serve trivial $TRIVIAL
for dt in bf16 fp32; do
  timeout 30 "$B/moeserve-cli" forward --target 127.0.0.1:$PORT --tokens 1 --dtype $dt \
    > "$OUT/forward_trivial_$dt.log" 2>&1
  row "trivial M=1 $dt one call" "$(grep -E 'server_timings|latency' "$OUT/forward_trivial_$dt.log" | tr '\n' ' ')"
done
load trivial_M1_c1 1 1 2000
load trivial_M1_c1_stream 1 1 2000 --stream
# The same calls asking for the host clock's timings only: no stage timers in the step (an
# untimed call's server total, which the target is about).
load trivial_M1_c1_host 1 1 2000 --host_timings_only
stop

echo "host CPU over the run: $(cpu_since "$cpu0")" | tee -a "$OUT/host_cpu.txt"
echo "=================== summary ==================="
printf '%s\n' "${ROWS[@]}"
echo "------------------- targets -------------------"
for wf in ${WFS:-mxfp8 bf16}; do
  t1=$(val ${wf}_M16_c1 requests_per_s); t8=$(val ${wf}_M16_c8 requests_per_s)
  t8s=$(val ${wf}_M16_c8_stream requests_per_s); t8l=$(val ${wf}_M16_c8_1lane requests_per_s)
  p1=$(val ${wf}_M16_c1 p50); p8=$(val ${wf}_M16_c8 p50); p8s=$(val ${wf}_M16_c8_stream p50)
  echo "$wf 8 callers M=16: throughput x$(ratio "$t8" "$t1") (stream x$(ratio "$t8s" "$t1"), 1 step in flight x$(ratio "$t8l" "$t1")) [>= 5]," \
    "p50 x$(ratio "$p8" "$p1") (stream x$(ratio "$p8s" "$p1")) [<= 2]"
  a=$(val ${wf}_M1024_c1 requests_per_s); b=$(val ${wf}_M1024_c2 requests_per_s)
  a1=$(val ${wf}_M1024_c1_1lane requests_per_s); b1=$(val ${wf}_M1024_c2_1lane requests_per_s)
  echo "$wf 2 callers M=1024: throughput x$(ratio "$b" "$a") [>= 1.6]; with 1 step in flight x$(ratio "$b1" "$a1")"
done
cat "$OUT/host_cpu.txt"
echo "trivial M=1 server total p50 us: $(grep -o 'server_total_us: p50=[0-9.]*' "$OUT/load_trivial_M1_c1.log" | cut -d= -f2) timed," \
  "$(grep -o 'server_total_us: p50=[0-9.]*' "$OUT/load_trivial_M1_c1_host.log" | cut -d= -f2) untimed [<= 40]"
p99u=$(val mxfp8_M16_c1 p99); p99o=$(grep -o 'p99=[0-9.]*' "$OUT/load_overload.log" | head -1 | cut -d= -f2)
# The target's reading: answers timed from when the schedule sent them (the senders' lag kept).
p99s=$(grep -E '^latency_from_schedule' "$OUT/load_overload.log" | grep -o 'p99=[0-9.]*' | cut -d= -f2)
echo "overload: answered p99 from the schedule ${p99s} ms vs unloaded p99 ${p99u} ms:" \
  "x$(ratio "$p99s" "$p99u") [< 5] (from the send ${p99o} ms: x$(ratio "$p99o" "$p99u"));" \
  "$(grep -E '^send_lag' "$OUT/load_overload.log"); $(grep -E '^sent=' "$OUT/load_overload.log")"
