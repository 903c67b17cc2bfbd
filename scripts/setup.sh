#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with Raven and its test tools.
# Usage: scripts/setup.sh [--dev]   (--dev adds pytest, hypothesis, ruff, mypy)
# Raven is installed editable, pure Python by default. RAVEN_COMPILE=1 scripts/setup.sh compiles its per-scrape
# modules with mypyc (raven/build.py lists them; gcc and the Python headers are needed; 1-4 minutes) and rebuilds
# them whenever one of their sources changed, so an edit is never shadowed by a stale .so; at run time
# RAVEN_BUILD=pure runs the pure modules from the same install (README "Compiled and pure builds"). The default
# stays pure until the compiled build pays end to end (docs/performance.md: within noise of the pure one today).
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
pip() { .venv/bin/pip --disable-pip-version-check "$@"; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
    echo "setup: installing Raven${extra} and its dependencies into .venv (log: .venv/pip.log)"
    # The dependencies and the build tools first (a pure editable install), then the compiled build below.
    # mypyc's tools (mypy, and the stubs it checks the compiled modules' imports with) are the same three places:
    # here, scripts/image.sh's wheels and the Dockerfile's builder.
    if ! { pip install --upgrade pip "setuptools>=68" wheel "mypy>=1.10" "types-PyYAML>=6.0" &&
           RAVEN_COMPILE=0 pip install -e ".${extra}"; } >.venv/pip.log 2>&1; then
        tail -30 .venv/pip.log >&2
        echo "setup: pip install failed (full log: .venv/pip.log)" >&2
        exit 1
    fi
    rm -f .venv/.compiled
    touch "$stamp"
fi
compiled=".venv/.compiled"
if [ "${RAVEN_COMPILE:-0}" = "0" ]; then
    # The pure build: no compiled module may shadow its source (an editable install builds them in place).
    find raven gateway agent -name '*.cpython-*.so' -delete 2>/dev/null || true
    rm -f ./*__mypyc.cpython-*.so "$compiled"
elif [ -f raven/build.py ] && { [ ! -f "$compiled" ] ||
        [ -n "$(find raven/build.py $(.venv/bin/python raven/build.py) -newer "$compiled")" ]; }; then
    echo "setup: compiling the per-scrape modules with mypyc (log: .venv/build.log)"
    # Compiled modules of an earlier list would shadow their sources: only the new build's remain.
    find raven gateway agent -name '*.cpython-*.so' -delete
    rm -f ./*__mypyc.cpython-*.so
    if ! pip install --no-build-isolation --no-deps -e . >.venv/build.log 2>&1; then
        tail -30 .venv/build.log >&2
        echo "setup: the mypyc build failed (full log: .venv/build.log); RAVEN_COMPILE=0 (the default) installs the pure build" >&2
        exit 1
    fi
    touch "$compiled"
fi
.venv/bin/raven --version
