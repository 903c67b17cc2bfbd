#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with Raven and its test tools.
# Usage: scripts/setup.sh [--dev]   (--dev adds pytest, hypothesis, ruff, mypy)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: Python 3.11 or newer is required (found $("$PY" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
extra=""
if [ "${1:-}" = "--dev" ]; then extra="[dev]"; fi
stamp=".venv/.installed${extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check --upgrade pip
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".${extra}"
    touch "$stamp"
fi
