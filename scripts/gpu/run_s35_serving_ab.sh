#!/usr/bin/env bash
# Issue 12's serving benchmark (seed layer MXFP8, no overload, no one-lane server) twice on the
# same warm host: the default server, then every server with SERVE_EXTRA_B (default
# "--inline_request_bytes=0": requests decoded on a polling worker that runs an idle step itself),
# so a default change is weighed on 8 callers, M=1024 overlap and the one-token call together.
# Each pass's summary and targets last. Usage: run_s35_serving_ab.sh BUNDLE.tgz (as
# run_s35_check.sh; SA_READY=1 reuses an unpacked bundle).
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/bundle_lib.sh
start_device_script "$1" > /dev/null || exit 1
ROOT=${OUT}
ln -sf "$B/moeserve_${LAST:-b}" "$B/moeserve"  # the bundle's build b (make_ab_bundle.sh)
for pass in a b; do
  extra=""
  [ $pass = b ] && extra=${SERVE_EXTRA_B:-"--inline_request_bytes=0"}
  OUT=$ROOT/serving_$pass SERVE_EXTRA=$extra WFS=mxfp8 SKIP_OVERLOAD=1 SKIP_1LANE=1 \
    bash tests/benchmarks/serving/run_serving_bench.sh "$B" > "$ROOT/serving_$pass.txt" 2>&1
done
for pass in a b; do
  label=default
  [ $pass = b ] && label=${SERVE_EXTRA_B:-"--inline_request_bytes=0"}
  echo "=== serving pass $pass: $label"
  sed -n '/^=* summary/,$p' "$ROOT/serving_$pass.txt" | grep -v '^mxfp8 2 callers.*1 step\|overload\|RSS' 
done
