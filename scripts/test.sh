#!/usr/bin/env bash
# The whole test run: lint, the package, the README's demos and the Celery quick start from a
# fresh clone, types, the docs, the suite on SQLite and on PostgreSQL, the guarantee tests on MariaDB, the wide
# pass on Django 6.1 and the smoke set on Django 6.0, and a brief soak; each step's time at the end. What CI runs (.ci/run)
# and what the README tells developers to run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ensure-services.sh
make --no-print-directory venv
PY=.venv/bin/python

# Each step's time, printed as a table at the end (and where CI time goes).
times=()
step_name=
step_start=$SECONDS
run_start=$SECONDS
step() {  # step TITLE: the previous step ends, this one starts
  if [ -n "$step_name" ]; then
    times+=("$(printf '%6ds  %s' $((SECONDS - step_start)) "$step_name")")
  fi
  step_name=$1
  step_start=$SECONDS
  if [ -n "$1" ]; then echo "== $1"; fi
}

step "ruff"
.venv/bin/ruff check django_taskguard tests example_project bench
.venv/bin/ruff format --check django_taskguard tests example_project bench
step "package (build, contents, the wheel in a new startproject site)"
bash scripts/package-check.sh
step "the README's demo, both ways, from a fresh clone (its own venv, a private Redis)"
# Under a developer's leftover settings for the example project: each step must not see them.
REDIS_URL=redis://127.0.0.1:1/0 CELERY_BROKER_URL=redis://127.0.0.1:1/1 \
  EXAMPLE_DB=/nonexistent/demo.sqlite3 DJANGO_SETTINGS_MODULE=nowhere \
  bash scripts/demo-check.sh </dev/null
step "mypy (strict, django-stubs)"
$PY -m mypy
step "docs (mkdocs build --strict)"
docs_site=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-docs.XXXXXX")
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$docs_site"
rm -rf "$docs_site"

export TASKGUARD_SOAK_SECONDS="${TASKGUARD_SOAK_SECONDS:-15}"
# Each test carries a marker that says on which databases it runs (pure: SQLite; dialect: all
# three; server: PostgreSQL and MariaDB; once: PostgreSQL) and whether it must run alone
# (processes, browser, timing): tests/support/selection.py, docs/development.md "Markers".
# A pass runs the tests meant for its database in two parts: the in-process tests, several
# beside each other on both cores (pytest-xdist, each worker its own test database and Redis
# servers), then the serial ones (real processes, the browser), two at a time, one per core.
# Each part writes JUnit XML; what ran on each database is counted at the end
# (scripts/count-tests.py).
reports=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-reports.XXXXXX")
database_pass() {  # database_pass DATABASE WORKERS [pytest args]
  local database=$1 workers=$2
  shift 2
  TASKGUARD_TEST_DB=$database $PY -m pytest -p no:cacheprovider -n "$workers" \
    -m "not soak and not serial" --junitxml="$reports/$database-beside.xml" --durations=10 "$@"
  TASKGUARD_TEST_DB=$database $PY -m pytest -p no:cacheprovider -n 2 \
    -m "not soak and serial" --junitxml="$reports/$database-alone.xml" --durations=15 "$@"
}

step "tests on SQLite"
# The end-to-end tests fire for 10 s (TASKGUARD_SCHEDULER_TEST_SECONDS; 30 s alone).
TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-10}" \
  database_pass sqlite 2 "$@"
step "the example project's tests (written with django_taskguard.testing)"
(cd example_project && "../$PY" -m pytest -p no:cacheprovider)
step "tests on PostgreSQL"
# The run_schedules chaos test (three copies, 200 schedules; a SIGKILL, a SIGSTOP, a
# terminated connection) runs here only: 40 s of chaos (each event 8 s or more from the
# next), about 60 s in all. The end-to-end tests fire for 10 s: they count slots, and 10
# one-second slots with two copies or workers show what 20 did. Three workers beside each
# other: most of a PostgreSQL test is waiting on the server.
TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-10}" \
  TASKGUARD_SCHEDULER_CHAOS_SECONDS="${TASKGUARD_SCHEDULER_CHAOS_SECONDS:-40}" \
  database_pass postgres 3 "$@"
step "tests on MariaDB (a private server per worker)"
# Each process starts a private mariadbd in a temporary directory on a free port
# (tests/support/mariadb_server.py). test_mariadb.py races 8 processes for 200 slots at READ
# COMMITTED and at REPEATABLE READ (test_race.py's race, plus InnoDB's deadlock count).
TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-10}" \
  database_pass mariadb 2 "$@"
step "version matrix: the wide pass on Django 6.1 (SQLite, and the ledger on PostgreSQL)"
bash scripts/matrix.sh django61
step "version matrix: the smoke set on Django 6.0, and APScheduler 4 (a pre-release)"
bash scripts/matrix.sh django60 aps4
step "soak (TASKGUARD_SOAK_SECONDS=$TASKGUARD_SOAK_SECONDS; every chaos kind at least once)"
# No exit-5 escape: a soak that vanished (no test carries the marker) is a failure.
TASKGUARD_TEST_DB=postgres $PY -m pytest -m soak "$@"
step ""
echo "== what ran on each database (tests, and distinct test functions)"
$PY scripts/count-tests.py "$reports"
rm -rf "$reports"
echo "== times (seconds)"
printf '%s\n' "${times[@]}"
printf '%6ds  in all\n' $((SECONDS - run_start))
