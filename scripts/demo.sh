#!/usr/bin/env bash
# Set up (if needed) and run the Raven demo on this machine. Extra arguments go to `raven demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/raven demo "$@"
