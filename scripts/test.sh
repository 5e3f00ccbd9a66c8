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
step "tests on SQLite (the \"once\" tests and the Redis chaos tests run in the PostgreSQL pass only)"
# The three-copies scheduler test runs 10 s here and 20 s in the PostgreSQL pass (30 s alone).
# The Redis chaos tests (Redis killed, paused, flushed, stalled; the row decides) run on
# PostgreSQL and, three of them, on MariaDB: the SQLite ledger's own takeovers and fencing
# are proven by test_guard.py and test_race.py here.
TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-10}" \
  $PY -m pytest -m "not soak and not once" --ignore tests/test_faults_redis.py --durations=25 "$@"
step "the example project's tests (written with django_taskguard.testing)"
(cd example_project && "../$PY" -m pytest)
# The wide pass on Django 6.1 (scripts/matrix.sh: the suite on SQLite without the
# process-heavy files, and the ledger's SQL on PostgreSQL), in a process group of its own,
# its output kept in a file: shown when it ends, it fails this script if it failed, and it
# is stopped if this script stops first. With TASKGUARD_MATRIX_BESIDE=1 it starts here,
# beside the PostgreSQL pass and the MariaDB set (less time in all; the two passes share nothing but the PostgreSQL
# server: their own test databases, Redis servers, RabbitMQ vhosts and application names).
# Not by default: on this 2-core machine the two passes at once made three timing-sensitive
# tests fail in one run of six (docs/development.md, "CI time").
matrix_pid=
start_matrix() {
  matrix_log=$(mktemp "${TMPDIR:-/tmp}/taskguard-django61.XXXXXX")
  set -m  # a process group of its own, so that all of it can be stopped
  bash scripts/matrix.sh django61 </dev/null >"$matrix_log" 2>&1 &
  matrix_pid=$!
  set +m
  trap 'kill -- -"$matrix_pid" 2>/dev/null || true; rm -f "$matrix_log"' EXIT
}
if [ "${TASKGUARD_MATRIX_BESIDE:-0}" = 1 ]; then
  start_matrix
  echo "== (started beside: the wide pass on Django 6.1, scripts/matrix.sh django61)"
fi

step "tests on PostgreSQL"
# The run_schedules chaos test (three copies, 200 schedules; a SIGKILL, a SIGSTOP, a
# terminated connection) runs here only: 60 s of chaos, about 80 s in all.
TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-20}" \
  TASKGUARD_SCHEDULER_CHAOS_SECONDS="${TASKGUARD_SCHEDULER_CHAOS_SECONDS:-60}" \
  TASKGUARD_TEST_DB=postgres $PY -m pytest -m "not soak" --durations=25 "$@"
# MariaDB: the guarantee tests and a smoke set, not the whole suite (about 6.5 minutes there,
# over CI's budget; about 2 minutes this way). The session starts a private mariadbd in a
# temporary directory on a free port (tests/support/mariadb_server.py). test_mariadb.py races 8
# processes for 200 slots at READ COMMITTED and at REPEATABLE READ (test_race.py's race, plus
# InnoDB's deadlock count); test_guard.py and test_keyed.py hold the SIGKILL and SIGSTOP
# takeovers; the Redis flush mid-slot, a SIGKILL and a SIGSTOP on the Redis backend; cleanup,
# retention, the admin and its overview, health and metrics, run_schedules --once.
MARIADB_TESTS=(
  tests/test_mariadb.py
  tests/test_ledger.py
  tests/test_states.py
  tests/test_guard.py
  tests/test_keyed.py
  tests/test_faults_redis.py::test_redis_restart_and_flush__mid_slot_no_second_run
  tests/test_faults_redis.py::test_redis_kill__owner_sigkilled_retry_takes_over_once
  tests/test_faults_redis.py::test_redis_pause__1_5x_lease_taken_over_late_finish_refused
  tests/test_cleanup.py::test_cleanup_locks__sigkilled_owner_is_abandoned_and_next_slot_runs
  tests/test_cleanup.py::test_cleanup_locks__concurrent_commands_abandon_each_run_once
  tests/test_retention.py
  tests/test_admin.py
  tests/test_health.py
  tests/test_metrics.py
  tests/test_schedule_registry.py
  tests/test_contrib_tasks.py
  tests/test_owed.py
)
step "the guarantee tests and a smoke set on MariaDB (a private server)"
TASKGUARD_TEST_DB=mariadb $PY -m pytest -m "not soak and not once" "${MARIADB_TESTS[@]}" "$@"
step "version matrix: the wide pass on Django 6.1 (SQLite, and the ledger on PostgreSQL)"
if [ -z "$matrix_pid" ]; then start_matrix; fi
matrix_status=0
wait "$matrix_pid" || matrix_status=$?
trap - EXIT
cat "$matrix_log"
rm -f "$matrix_log"
if [ "$matrix_status" -ne 0 ]; then
  echo "!! the Django 6.1 pass failed (exit $matrix_status); its output is above" >&2
  exit "$matrix_status"
fi
step "version matrix: the smoke set on Django 6.0, and APScheduler 4 (a pre-release)"
bash scripts/matrix.sh django60 aps4
step "soak (TASKGUARD_SOAK_SECONDS=$TASKGUARD_SOAK_SECONDS; every chaos kind at least once)"
# No exit-5 escape: a soak that vanished (no test carries the marker) is a failure.
TASKGUARD_TEST_DB=postgres $PY -m pytest -m soak "$@"
step ""
echo "== times (seconds; with TASKGUARD_MATRIX_BESIDE=1 the Django 6.1 pass ran beside the PostgreSQL pass and the MariaDB set)"
printf '%s\n' "${times[@]}"
printf '%6ds  in all\n' $((SECONDS - run_start))
