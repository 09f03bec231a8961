#!/usr/bin/env bash
# Newcomer command 2: installs what is missing, builds, and runs every test (GPU tests skip
# cleanly where no GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j"${CTEST_JOBS:-2}" "$@"
