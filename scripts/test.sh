#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, types, unit and integration tests.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
scripts/system-deps.sh
scripts/validators.sh
.venv/bin/ruff check raven gateway agent tests bench
.venv/bin/mypy
exec .venv/bin/python -m pytest -q --durations=25 "$@"
