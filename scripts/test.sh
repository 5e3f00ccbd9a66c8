#!/usr/bin/env bash
# The whole test run: lint, the package, types, the docs, the suite on SQLite and on
# PostgreSQL, the smoke set on the other supported Django versions, and a brief soak. What CI
# runs (.ci/run) and what the README tells developers to run.
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
echo "== docs (mkdocs build --strict)"
docs_site=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-docs.XXXXXX")
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$docs_site"
rm -rf "$docs_site"

export TASKGUARD_SOAK_SECONDS="${TASKGUARD_SOAK_SECONDS:-15}"
echo "== tests on SQLite (the \"once\" tests run in the PostgreSQL pass only)"
# The three-copies scheduler test runs 10 s here and its full 30 s in the PostgreSQL pass.
TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-10}" \
  $PY -m pytest -m "not soak and not once" "$@"
echo "== the example project's tests (written with django_taskguard.testing)"
(cd example_project && "../$PY" -m pytest)
echo "== tests on PostgreSQL"
TASKGUARD_TEST_DB=postgres $PY -m pytest -m "not soak" "$@"
echo "== version matrix: the smoke set on Django 4.2, 6.0 and 6.1"
bash scripts/matrix.sh
echo "== soak (TASKGUARD_SOAK_SECONDS=$TASKGUARD_SOAK_SECONDS; every chaos kind at least once)"
# No exit-5 escape: a soak that vanished (no test carries the marker) is a failure.
TASKGUARD_TEST_DB=postgres $PY -m pytest -m soak "$@"
