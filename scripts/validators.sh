#!/usr/bin/env bash
# Install the schema validators that tests/integration/test_manifests.py runs on Raven's Prometheus Operator and
# cert-manager objects: the npm packages pinned in tests/support/validators/package-lock.json, installed with
# `npm ci` into tests/support/validators/node_modules (git-ignored). Needs Node.js 18 or newer and npm
# (scripts/system-deps.sh installs Debian's). Does nothing when node_modules matches the lock file.
set -euo pipefail
cd "$(dirname "$0")/../tests/support/validators"
stamp="node_modules/.raven-installed"
if [ -f "$stamp" ] && [ ! package-lock.json -nt "$stamp" ] && [ ! package.json -nt "$stamp" ]; then
    exit 0
fi
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "validators: node and npm are needed (bash scripts/system-deps.sh installs them)" >&2
    exit 1
fi
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 18 ]; then
    echo "validators: Node.js 18 or newer is needed, found $(node --version)" >&2
    exit 1
fi
echo "validators: npm ci in tests/support/validators (log: tests/support/validators/npm.log)"
# The packages declare node >= 22; they run on 18 (Debian bookworm's 18.20) and 20 as well (both checked), so
# npm's engine warning is not an error here.
if ! npm ci --no-audit --no-fund --engine-strict=false >npm.log 2>&1; then
    tail -30 npm.log >&2
    echo "validators: npm ci failed (full log: tests/support/validators/npm.log)" >&2
    exit 1
fi
touch "$stamp"
