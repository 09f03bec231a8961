#!/usr/bin/env bash
# One device call for the upload of large gRPC requests while they are gathered
# (--upload_min_bytes, core/cuda/host_upload.h): its tests, upload_bench, then an A/B of server
# flag sets on issue 11's gRPC path (run_flags_ab.sh: M=1024 over TCP, the trivial layer).
# Usage: run_upload_checks.sh TRANSPORT_BUNDLE TESTS_BUNDLE
#   TRANSPORT_BUNDLE: tests/benchmarks/transport/make_bundle.sh's .tar.xz.
#   TESTS_BUNDLE: a .tgz of tests/bin (host_upload_test, shared_memory_cuda_test, upload_bench);
#   they load the transport bundle's libraries.
#   CONFIGS, ROUNDS, MS, WAYS, LAYERS: passed to run_flags_ab.sh (defaults below).
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
OUT=${OUT:-/tmp/upload_out}
mkdir -p "$OUT" /tmp/upload_tests
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tar -C /tmp/upload_tests -xzf "$2"
tar -C /tmp/upload_tests -xJf "$1"
T=/tmp/upload_tests/tests
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
for t in host_upload_test shared_memory_cuda_test; do
  LD_LIBRARY_PATH=$T/lib:/tmp/upload_tests/transport/lib${NCCL_DIR:+:$NCCL_DIR} \
    MOESERVE_BINARY=/tmp/upload_tests/transport/bin/moeserve timeout 120 "$T/bin/$t" \
    > "$OUT/$t.log" 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$t.log" | tr '\n' ' ')"
  grep -E -A3 '^\[  FAILED |Failure' "$OUT/$t.log" | head -20
done
grep -E "^grpc bytes" "$OUT/shared_memory_cuda_test.log" | head -20
# The upload without gRPC: serial gather + copy against the overlapped parts, by chunk size.
LD_LIBRARY_PATH=/tmp/upload_tests/transport/lib timeout 120 "$T/bin/upload_bench" --iters 30 \
  --threads 4,8 --chunks_kib 256,512,1024,2048 > "$OUT/upload_bench.txt" 2>&1
echo "upload_bench rc=$?"
grep -E "case=(serial|h2d_warm|upload)" "$OUT/upload_bench.txt" | sed 's/piece=16384 //'
CONFIGS=${CONFIGS:-"defaults|--upload_min_bytes=4194304|--upload_min_bytes=4194304 --gather_threads=8"} \
  ROUNDS=${ROUNDS:-2} MS=${MS:-1024} WAYS=${WAYS:-tcp} LAYERS=${LAYERS:-trivial} \
  BUDGET_S=${BUDGET_S:-60} OUT=/tmp/flags_ab bash "$repo/tests/benchmarks/transport/run_flags_ab.sh" "$1"
mkdir -p "$OUT/flags" && cp /tmp/flags_ab/*.txt "$OUT/flags/" 2>/dev/null
