#!/usr/bin/env bash
# The layer-3 demo (root: network namespaces and TUN devices). Builds the layer-3 testbed on this machine (a
# cloud namespace with the gateway and a cloud pod, two edge sites behind NAT routers, agents on their gateway
# nodes, raven routes on a node behind one of them; deploy/testbed/topology.sh l3), pings an edge node's IP
# from the cloud pod through the tunnel, runs a short TCP transfer verified by sha256, prints the figures, and
# tears everything down, also on Ctrl-C or failure. Exits 0 only if the ping and the transfer both worked.
#
#   sudo bash scripts/l3-demo.sh [--megabytes 32]
#
# RAVEN_PYTHON=/path/to/python uses that interpreter (with Raven's dependencies) instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
    echo "l3-demo: needs root (network namespaces, TUN devices, routes): sudo bash scripts/l3-demo.sh" >&2
    exit 1
fi
export PATH="$PATH:/usr/sbin:/sbin"
if ! command -v nft >/dev/null 2>&1 || ! command -v ping >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 \
    || ! command -v iperf3 >/dev/null 2>&1; then
    scripts/system-deps.sh
fi
PY=${RAVEN_PYTHON:-}
if [ -z "$PY" ]; then
    scripts/setup.sh
    PY=.venv/bin/python
fi
# The Python side tears down what it built; this is the safety net if it could not (killed, crashed).
trap 'bash deploy/testbed/topology.sh l3 down >/dev/null 2>&1 || true' EXIT
trap 'echo "l3-demo: interrupted" >&2; exit 130' INT TERM
PYTHONPATH="$PWD" "$PY" -m tests.support.l3testbed demo "$@"
