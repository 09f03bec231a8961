#!/usr/bin/env bash
# The torch client's gRPC calls by the C++ client (moeserve_client.native) against grpcio and
# moeserve-cli, on one device call: the transport bundle (tests/benchmarks/transport/make_bundle.sh,
# with lib/libmoeserve_client_c.so) and the wheels of .gpucarry/wheels; a server of trivial
# experts (H7168 I64, CUDA) on a unix socket; bench_client.py at M = MS (default "1 16 64"),
# CPU tensors as gRPC bytes, ROUNDS (3) alternating rounds of N (400) calls; then the same with
# the C++ client polling (SPIN_US, default 2000, and the cli's --client_spin_us alike); then a
# cProfile of the torch loop at M=1. Usage: run_torch_native.sh [BUNDLE]   (writes under $OUT)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
BUNDLE=${1:-$repo/.bundle/transport.tar.xz}
OUT=${OUT:-/tmp/torch_native}
source "$here/transport_lib.sh"
use_transport_bundle "$BUNDLE" || exit 1
python3 "$repo/tests/benchmarks/transport/py_deps.py" "$repo/.gpucarry/wheels" "$OUT/pydeps" \
  > "$OUT/py_deps.log" 2>&1 || { tail -3 "$OUT/py_deps.log"; exit 1; }
export PYTHONPATH=$OUT/pydeps
serve_trivial_unix --enable_shared_memory
bench() {
  timeout 200 python3 "$repo/clients/python/examples/bench_client.py" --target "unix:$sock" \
    --cli "$B/moeserve-cli" --tokens "${MS:-1,16,64}" --calls "${N:-400}" \
    --rounds "${ROUNDS:-3}" --no-numpy "$@" 2>"$OUT/bench_err.log" | grep -v '^# \['
}
# PROFILE_ONLY=1: only the cProfile, of the bench_client.py flags in EXTRA (e.g. "--device cuda
# --shared-memory cuda": the CUDA-region path; the server then needs --enable_shared_memory).
if [ -z "${PROFILE_ONLY:-}" ]; then
  echo "== torch client, CPU tensors, gRPC bytes (no polling)"
  bench
  echo "== the same, the C++ client polling ${SPIN_US:-2000} us (torch native_spin_us, cli --client_spin_us)"
  bench --native-spin-us "${SPIN_US:-2000}"
fi
echo "== cProfile of the torch loop at M=1 (top functions) ${EXTRA:-}"
# shellcheck disable=SC2086
MS=1 N=2000 ROUNDS=1 bench --profile 1 ${EXTRA:-}
grep -A30 "Ordered by: cumulative" "$OUT/bench_err.log" | head -34
grep -A22 "Ordered by: internal" "$OUT/bench_err.log" | head -26
kill "$pid"
wait "$pid" 2>/dev/null
