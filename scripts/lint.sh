#!/usr/bin/env bash
# clang-format (every C++ and CUDA source: no change allowed) and clang-tidy (.clang-tidy's
# checks, warnings are errors) over the C++ sources of core/, server/, clients/ and proto/, on
# the compile commands of build/ (scripts/build.sh makes them). Exit 1 with the findings.
#   scripts/lint.sh            everything (about 8 minutes on 2 cores for clang-tidy)
#   scripts/lint.sh FILE...    clang-tidy on these .cc files only (after an edit)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --lint >/dev/null
BUILD_DIR=${BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/compile_commands.json" ]]; then
  echo "lint: $BUILD_DIR/compile_commands.json missing: run scripts/build.sh first" >&2
  exit 2
fi

status=0
mapfile -t sources < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^tests/cuda/logs/')
if ! clang-format --dry-run -Werror "${sources[@]}" 2>/tmp/moeserve-format.log; then
  grep -m 40 "error:" /tmp/moeserve-format.log >&2 || true
  echo "lint: clang-format would change the files above (clang-format -i them)" >&2
  status=1
else
  echo "lint: clang-format: ${#sources[@]} files clean"
fi

if (($#)); then
  files=("$@")
else
  mapfile -t files < <(git ls-files 'core/*.cc' 'server/*.cc' 'clients/*.cc' 'proto/*.cc')
fi
# Only files the build compiles (e.g. CUDA-only sources in a CPU build have no command).
mapfile -t compiled < <(python3 - "$BUILD_DIR/compile_commands.json" "${files[@]}" <<'PY'
import json, os, sys
known = {os.path.realpath(e["file"]) for e in json.load(open(sys.argv[1]))}
for f in sys.argv[2:]:
    if os.path.realpath(f) in known:
        print(f)
PY
)
start=$(date +%s)
if ! run-clang-tidy -p "$BUILD_DIR" -j "${LINT_JOBS:-$(nproc)}" -quiet "${compiled[@]/#/$PWD/}" \
    >/tmp/moeserve-tidy.log 2>&1; then
  sed 's/\x1b\[[0-9;]*m//g' /tmp/moeserve-tidy.log | grep -E "(warning|error):" | sort -u |
    head -60 >&2 || true
  echo "lint: clang-tidy found the above (full log: /tmp/moeserve-tidy.log)" >&2
  status=1
else
  echo "lint: clang-tidy: ${#compiled[@]} files clean in $(($(date +%s) - start)) s"
fi
exit $status
