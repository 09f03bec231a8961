# Sourced by the device scripts that start one moeserve at a time and load it with moeserve-cli:
#   serve NAME FLAGS...   starts $B/moeserve on 127.0.0.1:$PORT (metrics on $PORT + 1) with FLAGS
#                         and $SERVE_EXTRA (flags for every server of a script), $SERVE_ENV
#                         (VAR=value words) added to its environment; waits up to 300 s
#                         for its ready file; leaves SERVER_PID; log $OUT/server_NAME.log
#   stop                  SIGTERM and wait
#   load TAG TOKENS CONCURRENCY REQUESTS [FLAGS...]
#                         moeserve-cli load (balanced routing, LOAD_MAX_SECONDS, default 60;
#                         gRPC's poll strategy CLIENT_POLL, default poll: see serving/RESULTS.md
#                         18:00, one process's callers then do not share one poller) ->
#                         $OUT/load_TAG.log, then `row TAG SUMMARY` (the caller defines row)
#   val TAG KEY           the first KEY=value of $OUT/load_TAG.log (e.g. val x requests_per_s)
#   overload TAG RATE     issue 12's overload: an open loop of RATE calls/s at M=16 for 10 s over
#                         32 connections (every answer checked against its unloaded answer),
#                         server RSS sampled every 0.25 s -> $OUT/load_TAG.log, $OUT/rss_TAG.txt;
#                         `row` for the outcomes and for the RSS (before, peak, after); with
#                         CLIENTS=N, N client processes share the rate and the connections;
#                         TARGET: another address than 127.0.0.1:$PORT (e.g. a unix socket)
#   ratio A B             A / B to two decimals ("n/a" when B is not positive)
#   phases                the server's merged-step phases and turnarounds so far (metrics)
#   phase_delta A B       per merged step between two `phases` readings
#   use_bundle FILE       unpacks a transport bundle (make_bundle.sh's .tar.xz) into /tmp/tb and
#                         sets B and LD_LIBRARY_PATH to it
# Needs B (the folder of moeserve and moeserve-cli), OUT and PORT.
serve() {
  local name=$1
  shift
  rm -f "$OUT/ready_$name"
  # shellcheck disable=SC2086
  env ${SERVE_ENV:-} "$B/moeserve" --listen 127.0.0.1:$PORT --metrics_address 127.0.0.1:$((PORT + 1)) \
    --ready_file "$OUT/ready_$name" "$@" ${SERVE_EXTRA:-} > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    [ -s "$OUT/ready_$name" ] && break
    kill -0 $SERVER_PID 2>/dev/null || break
    sleep 0.5
  done
}
stop() { kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null; }
load() {
  local tag=$1 m=$2 c=$3 n=$4
  shift 4
  GRPC_POLL_STRATEGY=${CLIENT_POLL:-poll} \
    timeout 180 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens "$m" --concurrency "$c" \
    --requests "$n" --routing balanced --max_seconds "${LOAD_MAX_SECONDS:-60}" "$@" \
    > "$OUT/load_$tag.log" 2>&1
  row "$tag" "$(grep -E 'latency_ms|server_total|server_stages|requests_per_s' "$OUT/load_$tag.log" |
    sed 's/tokens_per_s=.*//' | tr '\n' ' ')"
}
val() { grep -o "$2=[0-9.]*" "$OUT/load_$1.log" | head -1 | cut -d= -f2; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
use_bundle() {
  rm -rf /tmp/tb && mkdir -p /tmp/tb && tar -C /tmp/tb -xJf "$1" || return 1
  B=/tmp/tb/transport/bin
  export LD_LIBRARY_PATH=/tmp/tb/transport/lib
}
overload() {
  local tag=$1 rate=$2 rss0 rss_pid n=${CLIENTS:-1} i
  rss0=$(awk '/VmRSS/ {print $2}' /proc/$SERVER_PID/status)
  ( while kill -0 $SERVER_PID 2>/dev/null; do
      awk '/VmRSS/ {print $2}' /proc/$SERVER_PID/status; sleep 0.25; done ) > "$OUT/rss_$tag.txt" &
  rss_pid=$!
  if ((n <= 1)); then
    timeout 120 "$B/moeserve-cli" load --target "${TARGET:-127.0.0.1:$PORT}" --tokens 16 --rate "$rate" \
      --concurrency 32 --max_seconds 10 --routing balanced --distinct_inputs 8 \
      > "$OUT/load_$tag.log" 2>&1
    echo "exit=$?" >> "$OUT/load_$tag.log"
  else
    # CLIENTS processes of rate/n calls/s over 32/n connections each (a client whose own CPU
    # lags its schedule measures itself, not the server); one summary in load_TAG.log: counts
    # summed, each percentile the worst process's (an upper bound).
    local pids=()
    for i in $(seq "$n"); do
      timeout 120 "$B/moeserve-cli" load --target "${TARGET:-127.0.0.1:$PORT}" --tokens 16 \
        --rate "$(awk -v r="$rate" -v n="$n" 'BEGIN { print r / n }')" \
        --concurrency $((32 / n)) --max_seconds 10 --routing balanced --distinct_inputs 8 \
        > "$OUT/load_$tag.$i.log" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    python3 - "$OUT/load_$tag" "$n" > "$OUT/load_$tag.log" <<'PY'
import re, sys
base, n = sys.argv[1], int(sys.argv[2])
texts = [open(f"{base}.{i}.log").read() for i in range(1, n + 1)]
sums = {}
for t in texts:
    line = re.search(r"^sent=.*$", t, re.M)
    for k, v in re.findall(r"\b(sent|ok|refused|other_errors|wrong_answers)=(\d+)", line.group(0) if line else ""):
        sums[k] = sums.get(k, 0) + int(v)
ran = sum(1 for t in texts if re.search(r"^sent=", t, re.M))
print(" ".join(f"{k}={v}" for k, v in sums.items()) + f" clients={n} ran={ran}")
for i, t in enumerate(texts, 1):
    if not re.search(r"^sent=", t, re.M):
        err = re.search(r"^error: .*$", t, re.M)
        print(f"client{i} did not run (the run is not the overload asked for): "
              f"{err.group(0) if err else t.strip()[-300:]}")
for key in ("latency_ms", "latency_from_schedule_ms", "send_lag_ms", "server_total_us"):
    worst = {}
    for t in texts:
        m = re.search(rf"^{key}: (.*)$", t, re.M)
        for k, v in re.findall(r"(p50|p90|p99|max)=([0-9.]+)", m.group(1) if m else ""):
            worst[k] = max(worst.get(k, 0.0), float(v))
    print(f"{key}: " + " ".join(f"{k}={v:.3f}" for k, v in worst.items()))
for i, t in enumerate(texts, 1):
    m = re.search(r"^latency_ms_by_second_sent: (\S+)", t, re.M)
    print(f"client{i} latency_ms_by_second_sent: {m.group(1) if m else '-'}")
PY
  fi
  kill $rss_pid 2>/dev/null
  row "$tag rate=${rate}/s" "$(grep -E '^sent=|^latency_ms:|^latency_from_schedule|^send_lag' \
    "$OUT/load_$tag.log" | tr '\n' ' ')"
  row "$tag server RSS kB" "before=$rss0 peak=$(sort -n "$OUT/rss_$tag.txt" | tail -1) after=$(awk '/VmRSS/ {print $2}' /proc/$SERVER_PID/status)"
}
# use_tgz_bundle FILE NAME: unpacks a make_ab_bundle.sh-style FILE (NAME/bin: servers and
# moeserve-cli builds, NAME/lib: their libraries) into /tmp/NAME and sets BUNDLE_BIN,
# LD_LIBRARY_PATH, PORT, OUT (made) and a row() that prints (the A/B scripts).
use_tgz_bundle() {
  mkdir -p "/tmp/$2" && tar -C "/tmp/$2" -xzf "$1" || return 1
  export LD_LIBRARY_PATH=/tmp/$2/$2/lib
  BUNDLE_BIN=/tmp/$2/$2/bin
  PORT=50171
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  row() { echo "== $1: $2"; }
}
# use_sv_bundle: use_tgz_bundle .bundle/sv.tgz sv, with SV_BIN (the overload A/B scripts).
use_sv_bundle() { use_tgz_bundle .bundle/sv.tgz sv && SV_BIN=$BUNDLE_BIN; }
# cpu_mark: the host's /proc/stat "cpu" line now (for cpu_since). cpu_since MARK: the host's CPU
# time since MARK as shares of all cores: busy (user, nice, system, irq, softirq), idle (idle,
# iowait) and steal (time the hypervisor gave another guest: a host with steal reads slower in
# every CPU-bound stage, the client's included).
cpu_mark() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $5 + $6, $9 }' /proc/stat; }
cpu_since() {
  local b0 i0 s0 b1 i1 s1
  read -r b0 i0 s0 <<< "$1"
  read -r b1 i1 s1 < <(cpu_mark)
  awk -v b=$((b1 - b0)) -v i=$((i1 - i0)) -v s=$((s1 - s0)) 'BEGIN {
    t = b + i + s; if (t <= 0) t = 1
    printf "busy %.0f%%, idle %.0f%%, steal %.1f%%", 100 * b / t, 100 * i / t, 100 * s / t }'
}
# Cumulative merged-step phases (us) and turnarounds: "steps arrivals take merge engine
# answers turnaround_count turnaround_us" (moeserve_batch_merged_step_seconds_total etc.).
phases() {
  python3 - "$((PORT + 1))" <<'PY'
import re, sys, urllib.request as u
text = u.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
def v(name, label=""):
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
out = [v("moeserve_batch_merged_steps_total")]
for p in ("arrivals", "take", "merge", "engine", "answers"):
    out.append(1e6 * v("moeserve_batch_merged_step_seconds_total", f'phase="{p}"'))
out += [v("moeserve_caller_turnaround_seconds_count"),
        1e6 * v("moeserve_caller_turnaround_seconds_sum")]
print(" ".join(f"{x:.0f}" for x in out))
PY
}
# Per merged step between two phases() readings: "steps=N arrivals= take= merge= engine=
# answers= (us per step) turnaround= (us per call)".
phase_delta() {
  awk -v a="$1" -v b="$2" 'BEGIN {
    split(a, x, " "); split(b, y, " "); n = y[1] - x[1]
    printf "merged_steps=%d", n
    split("arrivals take merge engine answers", name, " ")
    for (i = 2; i <= 6; ++i) printf " %s=%.0f", name[i - 1], (n > 0 ? (y[i] - x[i]) / n : 0)
    c = y[7] - x[7]
    printf " turnaround=%.0f (us; %d samples)\n", (c > 0 ? (y[8] - x[8]) / c : 0), c }'
}
