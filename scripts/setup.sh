#!/usr/bin/env bash
# Installs what moeserve needs to build and test on Debian 12 / Ubuntu 24.04, idempotently:
# Debian packages that are missing, then the Python packages the clients and tests use.
# Safe to re-run; does nothing when everything is present. --sanitizers adds clang and its
# sanitizer runtimes (for scripts/fuzz.sh and scripts/sanitize.sh).
set -euo pipefail

DEB_PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev
  libopenblas-dev nlohmann-json3-dev curl
)
PY_PACKAGES=(grpcio grpcio-tools protobuf numpy safetensors ml_dtypes)
# scripts/setup.sh --sanitizers (scripts/fuzz.sh, scripts/sanitize.sh): clang with its
# sanitizer and libFuzzer runtimes.
if [[ "${1:-}" == "--sanitizers" ]]; then
  DEB_PACKAGES+=(clang libclang-rt-dev)
fi

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
# pip name -> import name
declare -A PY_IMPORT=([grpcio]=grpc [grpcio-tools]=grpc_tools [protobuf]=google.protobuf
                      [numpy]=numpy [safetensors]=safetensors [ml_dtypes]=ml_dtypes)
py_missing=()
for p in "${PY_PACKAGES[@]}"; do
  "$PYTHON" -c "import ${PY_IMPORT[$p]}" >/dev/null 2>&1 || py_missing+=("$p")
done
if ((${#py_missing[@]})); then
  echo "setup: installing Python packages: ${py_missing[*]}"
  "$PYTHON" -m pip install -q "${py_missing[@]}" 2>/dev/null || \
    "$PYTHON" -m pip install -q --break-system-packages "${py_missing[@]}"
fi
echo "setup: dependencies present"
