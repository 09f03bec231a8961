# Sourced by run_torch_native.sh and run_native_overhead.sh (one device call each).
# use_transport_bundle BUNDLE: unpacks the transport bundle (tests/benchmarks/transport/
# make_bundle.sh) into $OUT, sets B (its bin/), LD_LIBRARY_PATH (its lib/, then the NCCL of
# this machine's PyTorch) and MOESERVE_CLIENT_LIB (its C interface to the C++ client).
use_transport_bundle() {
  mkdir -p "$OUT"
  tar -C "$OUT" -xJf "$1" || return 1
  B=$OUT/transport/bin
  local nccl
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  export LD_LIBRARY_PATH=$OUT/transport/lib${nccl:+:$nccl}
  export MOESERVE_CLIENT_LIB=$OUT/transport/lib/libmoeserve_client_c.so
}

# serve_trivial_unix [FLAGS...]: moeserve with trivial experts (H7168 I64) on a unix socket of
# a fresh folder, more flags after; sets sock (the socket) and pid, waits for the socket; log in
# $OUT/server.log.
serve_trivial_unix() {
  sock=$(mktemp -d)/moe.sock
  "$B/moeserve" --model tiny --hidden 7168 --intermediate 64 --listen "unix:$sock" \
    --metrics_address 127.0.0.1:0 "$@" > "$OUT/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do [ -S "$sock" ] && break; sleep 1; done
  sleep 2
}
