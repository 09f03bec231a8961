#!/usr/bin/env bash
# Builds the bundle that the A/B device scripts read (run_small_call_ab.sh and others that take
# bin/{moeserve,engine_forward_bench}_a and _b): those two binaries of two commits A and B, then
# moeserve-cli and B's GPU test binaries, stripped, with the shared libraries they load
# (/work/shared/tools/bundle-libs.sh or BUNDLE_LIBS), as NAME/bin and NAME/lib in OUT.tgz.
# Builds in BUILD_DIR (default build; configured for CUDA, e.g. BUILD_TYPE=Release
# scripts/build.sh): A first, then B incrementally. Needs a clean working tree; returns to the
# branch it started on. Usage: make_ab_bundle.sh A B OUT.tgz [NAME]   (NAME default "ab")
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 3 ] || { echo "usage: $0 A B OUT.tgz [NAME]" >&2; exit 2; }
A=$1 B=$2 OUT=$3 NAME=${4:-ab}
BUILD=${BUILD_DIR:-build}
LIBS=${BUNDLE_LIBS:-/work/shared/tools/bundle-libs.sh}
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "error: commit or stash your changes first" >&2
  exit 1
fi
start=$(git rev-parse --abbrev-ref HEAD)
[ "$start" != HEAD ] || start=$(git rev-parse HEAD)
trap 'git checkout -q "$start"' EXIT
TESTS="cuda_kernels_test cuda_experts_test engine_cuda_test host_upload_test shared_memory_cuda_test"
stage=$(mktemp -d)
mkdir -p "$stage/$NAME/bin"
for side in a b; do
  ref=$A
  [ $side = b ] && ref=$B
  git checkout -q "$ref"
  echo "== $side: $(git log --oneline -1)"
  # shellcheck disable=SC2086
  ninja -C "$BUILD" moeserve engine_forward_bench moeserve-cli $TESTS | tail -1
  cp "$BUILD/bin/moeserve" "$stage/$NAME/bin/moeserve_$side"
  cp "$BUILD/tests/benchmarks/engine/engine_forward_bench" "$stage/$NAME/bin/engine_forward_bench_$side"
done
cp "$BUILD/bin/moeserve-cli" "$stage/$NAME/bin/"
for t in $TESTS; do cp "$BUILD/tests/cuda/$t" "$stage/$NAME/bin/"; done
strip "$stage/$NAME/bin/"*
"$LIBS" "$stage/$NAME/lib" "$stage/$NAME/bin/"* > /dev/null
mkdir -p "$(dirname "$OUT")"
tar -C "$stage" -czf "$OUT" "$NAME"
rm -rf "$stage"
echo "$OUT: $(du -h "$OUT" | cut -f1) (keep it under the 64 MiB a call carries)"
