#!/usr/bin/env bash
# A/B of the forward channel's inline ("ch") way at large M: the transport benchmark's ch and
# shm-ch rows (trivial layer) with two server bundles in one call. Usage:
# run_channel_copy_ab.sh OLD.tar.xz NEW.tar.xz (make_bundle.sh's files). Prints both tables.
set -u
for tag in old new; do
  b=$1; [ $tag = new ] && b=$2
  rm -rf /tmp/t_$tag
  OUT=/tmp/t_$tag LAYERS=trivial WAYS="ch shm-ch" MS="${MS:-256 1024}" N=100 N_BIG=40 PY=0 \
    bash tests/benchmarks/transport/run_transport_device.sh "$b" > /tmp/t_$tag.log 2>&1
  echo "== $tag ($b): rc=$?"
  grep -E 'trivial (ch|shm-ch) M=' /tmp/t_$tag.log
  grep -E '^\| trivial' /tmp/t_$tag.log
done
