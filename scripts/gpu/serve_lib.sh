# Sourced by the device scripts that start one moeserve at a time and load it with moeserve-cli:
#   serve NAME FLAGS...   starts $B/moeserve on 127.0.0.1:$PORT (metrics on $PORT + 1), waits up
#                         to 300 s for its ready file; leaves SERVER_PID; log $OUT/server_NAME.log
#   stop                  SIGTERM and wait
#   load TAG TOKENS CONCURRENCY REQUESTS [FLAGS...]
#                         moeserve-cli load (balanced routing, LOAD_MAX_SECONDS, default 60) ->
#                         $OUT/load_TAG.log, then `row TAG SUMMARY` (the caller defines row)
#   val TAG KEY           the first KEY=value of $OUT/load_TAG.log (e.g. val x requests_per_s)
# Needs B (the folder of moeserve and moeserve-cli), OUT and PORT.
serve() {
  local name=$1
  shift
  rm -f "$OUT/ready_$name"
  "$B/moeserve" --listen 127.0.0.1:$PORT --metrics_address 127.0.0.1:$((PORT + 1)) \
    --ready_file "$OUT/ready_$name" "$@" > "$OUT/server_$name.log" 2>&1 &
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
  timeout 180 "$B/moeserve-cli" load --target 127.0.0.1:$PORT --tokens "$m" --concurrency "$c" \
    --requests "$n" --routing balanced --max_seconds "${LOAD_MAX_SECONDS:-60}" "$@" \
    > "$OUT/load_$tag.log" 2>&1
  row "$tag" "$(grep -E 'latency_ms|server_total|server_stages|requests_per_s' "$OUT/load_$tag.log" |
    sed 's/tokens_per_s=.*//' | tr '\n' ' ')"
}
val() { grep -o "$2=[0-9.]*" "$OUT/load_$1.log" | head -1 | cut -d= -f2; }
