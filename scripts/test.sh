#!/usr/bin/env bash
# The whole test run: lint, the suite on SQLite, PostgreSQL and MariaDB, the wide pass on
# Django 6.1 and the smoke set on Django 6.0, a brief soak, the package, the README's demos
# and the Celery quick start from a fresh clone, types, the docs; each step's time at the end.
# What CI runs (.ci/run) and what the README tells developers to run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ensure-services.sh
make --no-print-directory venv
PY=.venv/bin/python
run_start=$SECONDS

# Each part of the suite writes JUnit XML here; what ran on each database is counted at the
# end (scripts/count-tests.py). The in-process lane writes its steps' times here too.
reports=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-reports.XXXXXX")
export PY reports

# Each step's time, printed as a table at the end (and where CI time goes).
times=()
step_name=
step_start=$SECONDS
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

export TASKGUARD_SOAK_SECONDS="${TASKGUARD_SOAK_SECONDS:-15}"
# The end-to-end tests fire for 10 s (TASKGUARD_SCHEDULER_TEST_SECONDS; 30 s alone): they
# count slots, and 10 one-second slots with two copies or workers show what 20 did.
export TASKGUARD_SCHEDULER_TEST_SECONDS="${TASKGUARD_SCHEDULER_TEST_SECONDS:-10}"
# The run_schedules chaos test (three copies, 200 schedules; a SIGKILL, a SIGSTOP, a
# terminated connection), on PostgreSQL only: 40 s of chaos, each event 8 s or more from the
# next.
export TASKGUARD_SCHEDULER_CHAOS_SECONDS="${TASKGUARD_SCHEDULER_CHAOS_SECONDS:-40}"

# Each test carries a marker that says on which databases it runs (pure: SQLite; dialect: all
# three; file_and_server: SQLite and PostgreSQL; server: PostgreSQL and MariaDB; once:
# PostgreSQL) and whether it is "serial" (processes, browser): tests/support/selection.py,
# docs/development.md "Markers". The tests run in two lanes at once:
# - this one runs the serial tests (real processes and signals, the browser), two at a time,
#   one per core, database after database: they mostly wait (on their children, on windows
#   of one-second slots), and their children must start on time;
# - the in-process lane runs, at a lower priority (nice 10), the other tests several beside
#   each other (pytest-xdist; each worker its own test database and Redis servers), database
#   after database, then the version matrix: they take what CPU the serial tests leave, and
#   the serial tests keep theirs (the one-core CPU hog they must bear anyway).
part() {  # part DATABASE NAME WORKERS MARKS [pytest args]
  local database=$1 name=$2 workers=$3 marks=$4
  shift 4
  TASKGUARD_TEST_DB=$database $PY -m pytest -p no:cacheprovider -n "$workers" --dist worksteal -m "$marks" \
    --junitxml="$reports/$database-$name.xml" --durations=10 "$@"
}
lane_step() {  # lane_step TITLE COMMAND...: run it, its time appended to lane.times
  local title=$1 at=$SECONDS
  shift
  echo "== $title"
  "$@"
  printf '%6ds  %s\n' $((SECONDS - at)) "$title" >>"$reports/lane.times"
}
in_process_lane() {  # in_process_lane [pytest args]
  local started=$SECONDS
  lane_step "in-process tests on SQLite" part sqlite beside 2 "not soak and not serial" "$@"
  lane_step "the example project's tests (written with django_taskguard.testing)" \
    bash -c 'cd example_project && "../$PY" -m pytest -p no:cacheprovider'
  # Three workers: most of a PostgreSQL test is waiting on the server.
  lane_step "in-process tests on PostgreSQL" part postgres beside 3 "not soak and not serial" "$@"
  # Each worker starts a private mariadbd in a temporary directory on a free port
  # (tests/support/mariadb_server.py).
  lane_step "in-process tests on MariaDB (a private server per worker)" \
    part mariadb beside 2 "not soak and not serial" "$@"
  lane_step "version matrix: the wide pass on Django 6.1 (SQLite, and the ledger on PostgreSQL)" \
    bash scripts/matrix.sh django61
  lane_step "version matrix: the smoke set on Django 6.0, and APScheduler 4 (a pre-release)" \
    bash scripts/matrix.sh django60 aps4
  printf '%6ds  %s\n' $((SECONDS - started)) "the in-process lane in all" >>"$reports/lane.times"
}
export -f part lane_step in_process_lane

lane_log="$reports/lane.log"
# TASKGUARD_TEST_LANES=2: the in-process lane runs beside the serial tests (about 1,530 s on
# this 2-core machine, 2026-12-08, against about 2,000 one after the other); each of the two
# runs tried so far failed one serial test on a margin that the added load ran out (both
# widened since). Until three runs in a row are green that way, CI runs the lanes one after
# the other (1, the default): the in-process lane first, at full priority.
if [ "${TASKGUARD_TEST_LANES:-1}" = 2 ]; then
  step "the in-process lane starts beside this one (its output: at its end)"
  set -m # the lane gets its own process group: a failure here stops it and its workers too
  nice -n 10 bash -c 'set -euo pipefail; in_process_lane "$@"' lane "$@" >"$lane_log" 2>&1 &
  lane=$!
  set +m
else
  step "the in-process lane (then the serial tests)"
  in_process_lane "$@" 2>&1 | tee "$lane_log"
  lane=
fi
stop_lane() {
  if [ -n "$lane" ] && kill -0 "$lane" 2>/dev/null; then
    kill -- "-$lane" 2>/dev/null || true
    echo "== the in-process lane was stopped; its output so far:"
    cat "$lane_log"
  fi
}
trap stop_lane EXIT

step "serial tests on SQLite"
part sqlite alone 2 "not soak and serial" "$@"
step "serial tests on PostgreSQL"
part postgres alone 2 "not soak and serial" "$@"
step "serial tests on MariaDB"
# test_mariadb.py races 8 processes for 200 slots at READ COMMITTED and at REPEATABLE READ
# (test_race.py's race, plus InnoDB's deadlock count).
part mariadb alone 2 "not soak and serial" "$@"
step "soak (TASKGUARD_SOAK_SECONDS=$TASKGUARD_SOAK_SECONDS; every chaos kind at least once)"
# No exit-5 escape: a soak that vanished (no test carries the marker) is a failure.
TASKGUARD_TEST_DB=postgres $PY -m pytest -p no:cacheprovider -m soak "$@"
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

if [ -n "$lane" ]; then
  step "waiting for the in-process lane"
  status=0
  wait "$lane" || status=$?
  trap - EXIT
  echo "== the in-process lane's output"
  cat "$lane_log"
  if [ "$status" -ne 0 ]; then
    echo "== the in-process lane failed (exit $status)"
    exit "$status"
  fi
fi
trap - EXIT
step ""
echo "== what ran on each database (tests, and distinct test functions)"
$PY scripts/count-tests.py "$reports"
echo "== times (seconds): the serial lane and the checks"
printf '%s\n' "${times[@]}"
echo "== times (seconds): the in-process lane"
cat "$reports/lane.times"
rm -rf "$reports"
printf '%6ds  in all\n' $((SECONDS - run_start))
