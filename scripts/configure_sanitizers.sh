#!/usr/bin/env bash
# Configures (once) the clang ASan + UBSan build directory $1 shared by scripts/fuzz.sh and
# scripts/sanitize.sh: CPU only, no benchmarks, every object instrumented for ASan, UBSan (any
# undefined behaviour aborts) and libFuzzer coverage, the fuzz targets as libFuzzer binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=$1
scripts/setup.sh --sanitizers >/dev/null
[[ -f "$BUILD_DIR/build.ninja" ]] && exit 0
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="$SAN -fsanitize=fuzzer-no-link -Wno-unknown-warning-option" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
  -DMOESERVE_ENABLE_CUDA=OFF -DMOESERVE_BUILD_BENCHMARKS=OFF -DMOESERVE_BUILD_FUZZERS=ON \
  ${CMAKE_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_LAUNCHER} >/dev/null
