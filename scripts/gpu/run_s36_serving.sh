#!/usr/bin/env bash
# Issue 12's full serving benchmark (both weight formats, overload, one-lane server, trivial
# one-token call) on main's defaults, from a bundle made by make_ab_bundle.sh (build b).
# Usage: run_s36_serving.sh BUNDLE.tgz   (WFS, SKIP_OVERLOAD, SKIP_1LANE as run_serving_bench.sh)
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" > /dev/null || exit 1
ln -sf "$B/moeserve_${LAST:-b}" "$B/moeserve"
ROOT=$OUT
OUT=/tmp/serving timeout ${SERVING_S:-480} bash tests/benchmarks/serving/run_serving_bench.sh "$B" \
  > "$ROOT/serving.txt" 2>&1
echo "serving rc=$?"
(cd /tmp/serving && tar -czf "$ROOT/serving_logs.tgz" .) 2>/dev/null
sed -n '/=== summary ===/,$p' "$ROOT/serving.txt"
