#!/bin/bash
# CTest grpc_echo_bench_roundtrip: grpc_echo_bench's client against its server over TCP
# loopback and a unix socket, checking every answer byte (sizes of a Forward at M=1 and M=16,
# H7168 BF16, top-8), with both waits (--wait queue|callback) and a refused --wait; then
# against a server that corrupts its answers, where --check must fail; then the open loop against
# servers that refuse 60 of every 100 calls after and before reading them (every call counted,
# as answered or refused), and bad open-loop and refusal flags refused.
set -uo pipefail
bin=$1
dir=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$dir"' EXIT
start() {  # ready_file flags...
  local ready=$1; shift
  "$bin" server --ready_file "$ready" "$@" 2> "$ready.log" &
  pids+=($!)
  for _ in $(seq 200); do [ -s "$ready" ] && return 0; sleep 0.05; done
  echo "server did not start: $(cat "$ready.log")"; exit 1
}
sizes=$((1 * (7168 * 2 + 64))),$((16 * (7168 * 2 + 64)))
start "$dir/ok" --listen "127.0.0.1:0,unix:$dir/echo.sock"
tcp=$(head -1 "$dir/ok")
for target in "$tcp" "unix:$dir/echo.sock"; do
  for wait in queue callback; do
    "$bin" client --target "$target" --bytes "$sizes" --calls 5 --warmup 1 --check --wait $wait ||
      { echo "FAIL: echo over $target, --wait $wait"; exit 1; }
  done
done
"$bin" client --target "$tcp" --bytes 100 --calls 1 --wait sometimes 2> "$dir/wait.err"
[ $? -eq 2 ] && grep -q "not queue or callback" "$dir/wait.err" ||
  { echo "FAIL: --wait sometimes was not refused: $(cat "$dir/wait.err")"; exit 1; }
start "$dir/bad" --listen "unix:$dir/bad.sock" --corrupt
if "$bin" client --target "unix:$dir/bad.sock" --bytes 100 --calls 2 --warmup 0 --check; then
  echo "FAIL: --check did not catch a corrupted answer"; exit 1
fi
for early in "" --refuse_early; do
  start "$dir/refuse$early" --listen "unix:$dir/refuse$early.sock" --refuse_percent 60 $early
  # 400 calls; the warm-up calls (one per connection) are the server's first 4, all refused.
  line=$("$bin" openloop --target "unix:$dir/refuse$early.sock" --bytes 1000 --rate 400 \
    --seconds 1 --connections 4 --cq_threads 2 | head -1)
  echo "$line"
  case "$line" in
    *" sent=400 ok=160 refused=240 other_errors=0 "*) ;;
    *) echo "FAIL: open loop against a server refusing 60%${early:+ early}: $line"; exit 1 ;;
  esac
done
"$bin" openloop --target "$tcp" --bytes 100 --rate 0 2> "$dir/rate.err"
[ $? -eq 2 ] && grep -q "rate > 0" "$dir/rate.err" ||
  { echo "FAIL: --rate 0 was not refused: $(cat "$dir/rate.err")"; exit 1; }
"$bin" openloop --target "$tcp" --bytes 100 --rate 10 --connections 0 2> "$dir/conn.err"
[ $? -eq 2 ] && grep -q "connections in" "$dir/conn.err" ||
  { echo "FAIL: --connections 0 was not refused: $(cat "$dir/conn.err")"; exit 1; }
for bad in -1 101; do
  "$bin" server --listen "unix:$dir/never.sock" --refuse_percent $bad 2> "$dir/pct.err"
  [ $? -eq 2 ] && grep -q "expected a percentage" "$dir/pct.err" ||
    { echo "FAIL: --refuse_percent $bad was not refused: $(cat "$dir/pct.err")"; exit 1; }
done
echo PASS
