#!/usr/bin/env bash
# A real two-node Kubernetes 1.20 cluster on this machine, on loopback, built from Debian's
# sources into a cache outside the repository (docs/kubernetes.md):
#   scripts/kube-cluster.sh up | down | status | load IMAGE... | stop TARGET | start TARGET
# `up` prints one JSON line (kubeconfig, namespace, nodes, server); progress goes to stderr.
set -euo pipefail
exec python3 "$(dirname "$0")/kube_cluster.py" "$@"
