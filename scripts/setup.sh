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
    echo "setup: installing Raven${extra} and its dependencies into .venv (log: .venv/pip.log)"
    if ! { .venv/bin/pip install --disable-pip-version-check --upgrade pip &&
           .venv/bin/pip install --disable-pip-version-check -e ".${extra}"; } >.venv/pip.log 2>&1; then
        tail -30 .venv/pip.log >&2
        echo "setup: pip install failed (full log: .venv/pip.log)" >&2
        exit 1
    fi
    touch "$stamp"
fi
