#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with Raven and its test tools.
# Usage: scripts/setup.sh [--dev]   (--dev adds pytest, hypothesis, ruff, mypy)
# Raven is installed editable, its per-scrape modules compiled with mypyc (raven/build.py lists them; 1-4 minutes
# the first time), rebuilt whenever one of their sources changed, so an edit is never shadowed by a stale .so.
# The compiled build needs gcc and the Python headers (Debian: gcc python3-dev; scripts/system-deps.sh installs
# them): where they are missing, setup says so and installs the pure build, unless RAVEN_COMPILE=1 asked for the
# compiled one (then it fails). RAVEN_COMPILE=0 installs the pure build. At run time RAVEN_BUILD=pure runs the
# pure modules from the same install (README "Compiled and pure builds").
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
want="${RAVEN_COMPILE:-default}"
case "$want" in
    0 | 1 | default) ;;
    *) echo "setup: RAVEN_COMPILE must be 1 (the compiled build) or 0 (the pure one), not '$want'" >&2; exit 2 ;;
esac
pure() {  # the pure build: no compiled module may shadow its source (an editable install builds them in place)
    find raven gateway agent -name '*.cpython-*.so' -delete 2>/dev/null || true
    rm -f ./*__mypyc.cpython-*.so "$compiled"
}
if [ "$want" = "default" ]; then
    # What mypyc's build needs besides the venv's mypy: a C compiler that finds the C library's and Python's headers.
    inc="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("include"))')"
    if ! printf '#include <Python.h>\n' | gcc -fsyntax-only -I"$inc" -x c - >/dev/null 2>&1; then
        echo "setup: no C compiler or no C/Python headers here (Debian: apt-get install gcc libc6-dev" \
             "python3-dev): installing the pure build; RAVEN_COMPILE=1 makes this an error" >&2
        want=0
    fi
fi
if [ "$want" = "0" ]; then
    pure
elif [ -f raven/build.py ] && { [ ! -f "$compiled" ] ||
        [ -n "$(find raven/build.py $(.venv/bin/python raven/build.py) -newer "$compiled")" ]; }; then
    echo "setup: compiling the per-scrape modules with mypyc, 1-4 minutes (log: .venv/build.log; RAVEN_COMPILE=0 skips)"
    # Compiled modules of an earlier list would shadow their sources: only the new build's remain.
    find raven gateway agent -name '*.cpython-*.so' -delete
    rm -f ./*__mypyc.cpython-*.so
    if pip install --no-build-isolation --no-deps -e . >.venv/build.log 2>&1; then
        touch "$compiled"
    elif [ "$want" = "default" ]; then
        tail -5 .venv/build.log >&2
        echo "setup: the mypyc build failed (full log: .venv/build.log): installing the pure build;" \
             "RAVEN_COMPILE=1 makes this an error" >&2
        pure
        RAVEN_COMPILE=0 pip install --no-build-isolation --no-deps -e . >>.venv/build.log 2>&1
    else
        tail -30 .venv/build.log >&2
        echo "setup: the mypyc build failed (full log: .venv/build.log); RAVEN_COMPILE=0 installs the pure build" >&2
        exit 1
    fi
fi
.venv/bin/raven --version
