#!/usr/bin/env bash
# Configures and builds moeserve into ${BUILD_DIR:-build} (CUDA on wherever nvcc is found).
# TARGETS: what to build (default: everything, tests and benchmarks included); arguments go to
# the first configure.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  # nvcc may live outside PATH on CUDA machines.
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} "$@"
fi
# shellcheck disable=SC2086
ninja -C "$BUILD_DIR" -j"$JOBS" ${TARGETS:-}
