#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, types, unit, integration and e2e tests (on the pure build
# that setup.sh installs by default; with RAVEN_COMPILE=1, on the compiled build and the unit tests once more pure).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
scripts/system-deps.sh
scripts/validators.sh
.venv/bin/ruff check raven gateway agent tests bench
.venv/bin/mypy
# A compiled install (RAVEN_COMPILE=1 scripts/setup.sh): the unit suite once more on the pure build
# (RAVEN_BUILD=pure: the interpreted modules, same install); the whole suite below runs on the compiled build.
if [ -f .venv/.compiled ]; then
    RAVEN_BUILD=pure .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit
fi
exec .venv/bin/python -m pytest -q --durations=25 "$@"
