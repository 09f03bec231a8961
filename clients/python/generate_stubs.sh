#!/usr/bin/env bash
# Generates the Python gRPC stubs for moeserve.v1 and grpc.health.v1 from proto/ into
# moeserve_client/gen/ (gitignored), for using the client from the source tree without
# installing it (pip install builds its own: setup.py). Idempotent: regenerates into a scratch
# directory and then swaps it in, so re-running it (or running it while another run is in
# flight) is safe. The generation itself is build_stubs.py's, shared with setup.py.
#
# Needs grpcio-tools (pip install -r requirements.txt). Override the interpreter with $PYTHON
# and the proto root with $MOESERVE_PROTO_DIR.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
proto_dir="${MOESERVE_PROTO_DIR:-${here}/../../proto}"
python="${PYTHON:-python3}"
pkg="${here}/moeserve_client"
out="${pkg}/gen"

scratch="$(mktemp -d "${pkg}/.gen.XXXXXX")"
trap 'rm -rf "${scratch}" "${scratch}.old"' EXIT

"${python}" "${here}/build_stubs.py" "${scratch}" --proto-dir "${proto_dir}" >/dev/null
chmod 755 "${scratch}"

# Swap in the new tree. rename() of a directory onto a non-empty one fails, so move the old
# one aside first; a concurrent run that loses the race leaves an equivalent tree in place.
if [[ -d "${out}" ]]; then
  mv "${out}" "${scratch}.old" 2>/dev/null || true
fi
mv -T "${scratch}" "${out}" 2>/dev/null || true
if [[ ! -f "${out}/moeserve/v1/moeserve_pb2_grpc.py" ]]; then
  echo "generate_stubs.sh: ${out} is incomplete" >&2
  exit 1
fi
echo "generated ${out}"
