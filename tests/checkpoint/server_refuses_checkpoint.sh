#!/bin/sh
# Usage: server_refuses_checkpoint.sh MOESERVE CHECKPOINT_DIR PATTERN
# Passes when the server exits non-zero (not by a signal) on the checkpoint, printing an error
# that matches PATTERN (grep basic regex). A server that starts serving instead is killed by
# the CTest timeout, which fails the test.
# A free metrics port: the default 9464 may be held by a test running beside this one.
out=$("$1" --checkpoint "$2" --listen 127.0.0.1:0 --metrics_address 127.0.0.1:0 2>&1)
rc=$?
echo "$out"
echo "moeserve exit status: $rc"
[ "$rc" -ne 0 ] || { echo "FAIL: moeserve exited 0 on a corrupted checkpoint"; exit 1; }
[ "$rc" -lt 128 ] || { echo "FAIL: moeserve died from a signal"; exit 1; }
echo "$out" | grep -q "$3" || { echo "FAIL: the error does not match '$3'"; exit 1; }
echo "PASS"
