#!/usr/bin/env bash
# What a Python process adds to the C++ client's calls (moeserve_client.native): moeserve-cli
# load against native_loop.py's variants (tests/benchmarks/transport/native_loop.py), each a
# process of its own, ROUNDS (2) alternating rounds, trivial layer, M=1, unix socket.
# Usage: run_native_overhead.sh [BUNDLE]   (the transport bundle; writes under $OUT)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
BUNDLE=${1:-$repo/.bundle/transport.tar.xz}
OUT=${OUT:-/tmp/native_overhead}
source "$here/transport_lib.sh"
use_transport_bundle "$BUNDLE" || exit 1
serve_trivial_unix
echo "variant p50_us mean_us cpu_us"
for r in $(seq "${ROUNDS:-2}"); do
  for v in ${VARIANTS:-cli bare grpc chan torch spin clispin}; do
    case $v in
      cli | clispin)
        spin=0; [ $v = clispin ] && spin=2000
        /usr/bin/time -f "%U %S" -o "$OUT/time.txt" "$B/moeserve-cli" load --target "unix:$sock" \
          --tokens 1 --concurrency 1 --requests 3000 --dtype fp16 --return_timings=false \
          --client_spin_us=$spin > "$OUT/cli.log" 2>&1
        echo "$v $(grep -o 'p50=[0-9.]*' "$OUT/cli.log" | head -1 | awk -F= '{print $2 * 1000}') - $(awk '{printf "%.0f", ($1 + $2) / 3000 * 1e6}' "$OUT/time.txt")"
        ;;
      *) timeout 120 python3 "$repo/tests/benchmarks/transport/native_loop.py" "unix:$sock" "$v" ;;
    esac
  done
done
kill "$pid"
wait "$pid" 2>/dev/null
