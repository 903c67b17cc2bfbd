#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, types, the unit tests on the pure modules of the install,
# then unit, integration and e2e tests on the compiled build (what setup.sh installs and the image ships).
# RAVEN_COMPILE=0 runs everything on the pure build. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/system-deps.sh  # first: the compiled build needs gcc and the C and Python headers
RAVEN_COMPILE=${RAVEN_COMPILE:-1} scripts/setup.sh --dev
scripts/validators.sh
.venv/bin/ruff check raven gateway agent tests bench
.venv/bin/mypy
# Two pytest workers (pytest-xdist; RAVEN_TEST_WORKERS=N to change, 0 for none): the tests wait on real time
# (outages, timeouts, scrape intervals) about half of theirs. tests/support/xdistgroups.py keeps each module on one
# worker and runs the tests that hold machine-wide things (the netns testbeds, fixed ports) one at a time.
workers=${RAVEN_TEST_WORKERS:-2}
# A compiled install: the unit suite once more on the pure build (RAVEN_BUILD=pure: the interpreted modules, same
# install; tests/unit/test_build.py compares the two); the whole suite below runs on the compiled build.
if [ -f .venv/.compiled ]; then
    RAVEN_BUILD=pure .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" tests/unit
fi
exec .venv/bin/python -m pytest -q --durations=25 -n "$workers" "$@"
