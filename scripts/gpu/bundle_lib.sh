# Sourced by the device scripts. unpack_bundle BUNDLE.tgz unpacks a bundle made with
# `tar -C DIR -czf BUNDLE.tgz NAME` (NAME/bin: stripped binaries; NAME/lib: the shared libraries
# that /work/shared/tools/bundle-libs.sh collected for them) into /tmp/sa, then sets D (the
# bundle's folder), B (its bin/) and LD_LIBRARY_PATH (its lib/). With SA_READY set (a script
# called by another that unpacked already) the unpacked copy is reused.
unpack_bundle() {
  if [ -z "${SA_READY:-}" ]; then
    rm -rf /tmp/sa && mkdir -p /tmp/sa && tar -C /tmp/sa -xzf "$1" || return 1
  fi
  D=$(ls -d /tmp/sa/*/ | head -1)
  B=${D}bin
  export LD_LIBRARY_PATH=${D}lib
}

# start_device_script BUNDLE.tgz: makes $OUT (default /tmp/out), unpacks the bundle as above and
# names the GPU.
start_device_script() {
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  unpack_bundle "$1" || return 1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}

# run_gtest NAME SECONDS [ARGS...]: runs the bundle's test binary NAME into $OUT/NAME.log and
# prints its exit code, gtest's summary lines and the first failures.
run_gtest() {
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$B/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | tr '\n' ' ')"
  grep -E -A3 '^\[  FAILED |Failure' "$OUT/$name.log" | head -20
}
