#!/usr/bin/env bash
# The test suite (CPU). Creates .venv, installs moepipe (non-editable) with its test tools,
# then runs pytest; GPU tests are skipped visibly on machines without one.
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
scripts/install-test-tools.sh
.venv/bin/python -m ruff check pipeline tests benchmarks model_repo plugins
.venv/bin/python -m mypy  # the package, configured in pyproject.toml: zero errors
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
