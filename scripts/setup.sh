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
  libopenblas-dev nlohmann-json3-dev curl libssl-dev openssl
)
PY_PACKAGES=(grpcio grpcio-tools protobuf numpy safetensors ml_dtypes wheel)
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
                      [numpy]=numpy [safetensors]=safetensors [ml_dtypes]=ml_dtypes
                      [wheel]=wheel [torch]=torch)
# torch (the torch client's tests, tests/python/torch_client_test.py) is opt-in: PyPI's Linux
# wheels pull about 3 GB of CUDA libraries (several minutes), too much for every CI run; the
# test is skipped without it. MOESERVE_WITH_TORCH=1 installs it.
if [[ "${MOESERVE_WITH_TORCH:-0}" == 1 ]]; then
  PY_PACKAGES+=(torch)
fi
py_missing=()
for p in "${PY_PACKAGES[@]}"; do
  "$PYTHON" -c "import ${PY_IMPORT[$p]}" >/dev/null 2>&1 || py_missing+=("$p")
done
if ((${#py_missing[@]})); then
  echo "setup: installing Python packages: ${py_missing[*]}"
  "$PYTHON" -m pip install -q "${py_missing[@]}" 2>/dev/null || \
    "$PYTHON" -m pip install -q --break-system-packages "${py_missing[@]}"
fi
# CUTLASS C++ headers for the sm_90a grouped GEMM (kernels/cuda/moe_grouped_sm90.cu, found by
# cmake/FindCutlass.cmake): the headers alone are needed, so no dependencies (the package's
# Python side wants cuda-python, scipy, ...). A 6 MB wheel; -DMOESERVE_CUTLASS_DIR overrides.
CUTLASS_VERSION=4.2.0.0
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('cutlass_library') is None)" \
    >/dev/null 2>&1; then
  echo "setup: installing nvidia-cutlass==$CUTLASS_VERSION (headers)"
  "$PYTHON" -m pip install -q --no-deps "nvidia-cutlass==$CUTLASS_VERSION" 2>/dev/null || \
    "$PYTHON" -m pip install -q --no-deps --break-system-packages "nvidia-cutlass==$CUTLASS_VERSION"
fi
echo "setup: dependencies present"
