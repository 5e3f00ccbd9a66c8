#!/usr/bin/env bash
# The whole test run: lint, the package, types, the suite on SQLite and on PostgreSQL, and a
# brief soak. What CI runs (.ci/run) and what the README tells developers to run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ensure-services.sh
make --no-print-directory venv
PY=.venv/bin/python

echo "== ruff"
.venv/bin/ruff check django_taskguard tests example_project bench
.venv/bin/ruff format --check django_taskguard tests example_project bench
echo "== package (build, contents, the wheel in a new startproject site)"
bash scripts/package-check.sh
echo "== mypy (strict, django-stubs)"
$PY -m mypy

export TASKGUARD_SOAK_SECONDS="${TASKGUARD_SOAK_SECONDS:-15}"
echo "== tests on SQLite (the \"once\" tests run in the PostgreSQL pass only)"
$PY -m pytest -m "not soak and not once" "$@"
echo "== tests on PostgreSQL"
TASKGUARD_TEST_DB=postgres $PY -m pytest -m "not soak" "$@"
echo "== soak (TASKGUARD_SOAK_SECONDS=$TASKGUARD_SOAK_SECONDS; every chaos kind at least once)"
# No exit-5 escape: a soak that vanished (no test carries the marker) is a failure.
TASKGUARD_TEST_DB=postgres $PY -m pytest -m soak "$@"
