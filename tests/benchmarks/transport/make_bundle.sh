#!/bin/bash
# Packs what run_transport_device.sh needs on the device machine into one compressed file (the
# device call carries at most 64 MiB): stripped moeserve, moeserve-cli, grpc_echo_bench,
# copy_floor_bench from BUILD_DIR/bin (a CUDA build for sm_90a) in bin/, the shared libraries
# they load (not glibc's, the CUDA driver's or NCCL: the device machine has those) in lib/, with
# the C interface of the C++ client (lib/libmoeserve_client_c.so: the torch client's gRPC calls).
# Usage: make_bundle.sh [BUILD_DIR] [OUT_FILE]   (default build, .bundle/transport.tar.xz)
#   SERVER_BIN=path: take moeserve from another build of the same commit (default BUILD_DIR's).
set -euo pipefail
build=${1:-build}
out=${2:-.bundle/transport.tar.xz}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/transport/bin" "$stage/transport/lib" "$(dirname "$out")"
for b in moeserve moeserve-cli grpc_echo_bench copy_floor_bench libmoeserve_client_c.so; do
  path=$build/bin/$b dest=$stage/transport/bin/$b
  [ $b = moeserve ] && path=${SERVER_BIN:-$path}
  [ $b = libmoeserve_client_c.so ] && path=$build/lib/$b dest=$stage/transport/lib/$b
  if [ ! -x "$path" ]; then
    echo "missing $path (ninja -C $build ${b%.so})" >&2
    [ $b = copy_floor_bench ] && continue  # a build without CUDA has none
    exit 1
  fi
  strip --strip-unneeded -o "$dest" "$path"
  ldd "$path" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case $(basename "$lib") in
      libc.so* | libm.so* | libpthread.so* | librt.so* | libdl.so* | ld-linux* | libcuda.so* | \
        libnvidia-* | libnccl.so*) ;;  # NCCL: the device's (PyTorch's nvidia-nccl wheel)
      *) [ -e "$stage/transport/lib/$(basename "$lib")" ] ||
        strip --strip-unneeded -o "$stage/transport/lib/$(basename "$lib")" "$lib" ;;
    esac
  done
done
du -sh "$stage/transport/bin" "$stage/transport/lib"
tar -C "$stage" -cJf "$out" transport
du -h "$out"
