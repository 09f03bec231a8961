#!/usr/bin/env bash
# Newcomer command 1: installs what is missing, builds, and starts moeserve on its embedded
# default (CPU backend, the synthetic `tiny` model) on 127.0.0.1:50051 (metrics on
# 127.0.0.1:9464), reachable from this machine only. GetExpertWeights is on here so that
# `moeserve-cli forward --check` works; the server's own default is off (docs/security.md).
# Extra arguments go to the server, e.g. scripts/serve.sh --model qwen3-30b-a3b --num_layers 2
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Only the server and the client (about 40% of the build's commands); scripts/test.sh builds the
# rest.
TARGETS="moeserve moeserve-cli" scripts/build.sh
exec build/bin/moeserve --listen 127.0.0.1:50051 --metrics_address 127.0.0.1:9464 \
  --enable_get_expert_weights "$@"
