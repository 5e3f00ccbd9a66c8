#!/usr/bin/env bash
# The version matrix: every supported Django other than the main one (the main combination,
# Python 3.11 + Django 5.2, runs everything in .venv). The newest pair runs the wide pass
# (WIDE_SKIP, below); the others a smoke set. Each entry gets its own venv, .venv-<name>/,
# built by uv with the user extras [redis,celery,postgres] and [test] (no django-celery-beat:
# its releases require Django below 6.1, and the package must work without it); "wide"
# entries add what the rest of the suite needs (prometheus-client, django-tasks-db, huey). A venv
# is rebuilt only when pyproject.toml or its entry below changes (a stamp file inside it);
# uv's cache (~/.cache/uv) makes a rebuild take seconds. Called by scripts/test.sh (after
# the main passes); runs on its own too: `bash scripts/matrix.sh [NAME...]` (e.g. django61),
# with PostgreSQL up (scripts/ensure-services.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

UV=${UV:-.venv/bin/uv}

# name, Python, Django, what runs: the newest Python CI has for the newest Django, the wide
# pass; Django 6.0 with its oldest Python, the smoke set. (Python 3.14: no interpreter can be
# installed on the CI machine yet; see docs/development.md.)
MATRIX=(
  "django61 3.13 Django>=6.1,<6.2 wide"
  "django60 3.12 Django>=6.0,<6.1 smoke"
  "aps4 3.11 Django>=5.2,<6.0 aps4"
)
# APScheduler 4 is a pre-release whose API differs from 3.x (which the suite's own venv has):
# its entry installs this version instead and runs tests/test_apscheduler4.py alone.
APSCHEDULER4="apscheduler==4.0.0a6"
FULL_EXTRAS=(prometheus-client "django-tasks-db>=0.13" "sentry-sdk>=2.0" "opentelemetry-sdk>=1.20"
  "opentelemetry-instrumentation-celery>=0.41b0" "python-json-logger>=3.1" "dramatiq[redis]>=1.17" "huey>=3.0,<4" "rq>=3.0")

# The wide pass leaves out the files whose tests are about processes, signals and servers
# rather than Django (Redis killed, paused and flushed; a wire cut; run_schedules under
# SIGKILL and SIGSTOP; Celery clusters; the demos, which build their own venv): the main
# pass runs them on Django 5.2. It keeps everything that touches Django: the ORM and
# migrations, the admin (in a real browser too), checks, settings, django.tasks (Django's
# own on 6.x), async, the test kit, the commands. The whole suite on 6.1 took 24 minutes
# of CI's budget (2026-11-26); this takes about a third of that.
WIDE_SKIP=(
  tests/test_faults_redis.py
  tests/test_faults_wire.py
  tests/test_run_schedules_chaos.py
  tests/test_celery_e2e.py
  tests/test_rq_e2e.py
  tests/test_celery_apply_once.py
  tests/test_celery_retry_copies.py
  tests/test_checkins_e2e.py
  tests/test_dramatiq_e2e.py
  tests/test_huey_e2e.py
  tests/test_demo_check.py
  tests/test_mariadb.py
  # Processes racing, killed and stopped, on this Django as on the main one (their Django
  # surface, the ORM and the commands, runs in the files kept): about 6 minutes of the pass
  # (2026-11-27).
  tests/test_run_schedules.py
  tests/test_run_schedules_batch.py
  tests/test_data_run_schedules.py
  tests/test_upkeep.py
  tests/test_keyed.py
  tests/test_cleanup.py
  tests/test_async_edges.py
  # Each documented example twice (database, Redis): the main passes run them.
  tests/test_docs_examples.py
  tests/test_django_q2.py
  tests/test_apscheduler.py
)
# The ledger's PostgreSQL SQL (its functions, prepared statements, claims and races).
WIDE_POSTGRES=(
  tests/test_ledger.py
  tests/test_functions.py
  tests/test_prepared.py
  tests/test_race.py
  tests/test_states.py
  tests/test_health.py
)

# A race of real processes (on SQLite and on PostgreSQL; the rest on PostgreSQL only), the
# migrations check, an admin page rendered, the Celery beat scheduler stamping a slot and a task recording that slot, and
# a guarded call on the Redis backend (django-redis differs across Django versions), a slot
# carried by a django.tasks task (Django's own django.tasks on 6.x), and
# guarded coroutine functions: many tasks on one loop, cancellation (asyncio differs across
# Python versions).
SMOKE=(
  tests/test_race.py
  tests/test_locks_redis.py::test_guard__winner_folds_redis_duplicates_into_the_row
  tests/test_checks.py::test_makemigrations__check_reports_no_changes
  tests/test_admin.py::test_changelist__columns_badges_and_lease
  tests/test_admin.py::test_breadcrumbs__our_pages_draw_them_as_this_djangos_own_pages_do
  tests/test_contrib_celery.py::test_scheduler_stamp__headers_carry_slot_and_entry_name
  tests/test_contrib_celery.py::test_eager__slot_from_header_and_identity_with_schedule_name
  tests/test_contrib_celery.py::test_database_scheduler__without_django_celery_beat_names_the_extra
  tests/test_contrib_tasks.py::test_enqueue_for_slot__the_slot_travels_and_is_claimed_not_recomputed
  tests/test_async.py::test_async__many_tasks_one_slot_one_runs_and_the_loop_keeps_ticking
  tests/test_async.py::test_async__cancelled_during_the_claim_gives_the_slot_back_and_never_runs
  tests/test_async.py::test_async__wait_for_timeout_during_the_claim_raises_timeout_error_and_gives_back
  tests/test_async.py::test_async__a_timeout_in_the_function_raises_timeout_error_and_is_recorded
)


find_python() {  # python$1 that runs: on PATH, else pyenv's; else "$1", for uv to find
  local version=$1 candidate
  for candidate in "python$version" "${PYENV_ROOT:-$HOME/.pyenv}/versions/$version".*/bin/"python$version"; do
    if "$candidate" -c "" >/dev/null 2>&1; then
      command -v "$candidate"
      return
    fi
  done
  echo "$version"
}

build() {  # build() NAME PYTHON DJANGO KIND: make .venv-NAME current
  local venv=.venv-$1 stamp want extra=()
  stamp=.venv-$1/.taskguard-stamp
  want="$2 $3 $4 $(sha256sum pyproject.toml scripts/matrix.sh | cut -d' ' -f1 | tr '\n' ' ')"
  local extras="redis,celery,postgres,test"
  if [ "$4" = wide ]; then extra=("${FULL_EXTRAS[@]}"); fi
  if [ "$4" = aps4 ]; then  # [test] pins APScheduler 3: its other tools, and version 4
    extras="redis,celery,postgres"
    extra=("pytest>=8" "pytest-django>=4.8" "pytest-timeout>=2.3" "$APSCHEDULER4")
  fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  rm -rf "$venv"
  "$UV" venv -q --python "$(find_python "$2")" "$venv"
  "$UV" pip install -q --python "$venv/bin/python" -e ".[$extras]" "$3" "${extra[@]}"
  echo "$want" >"$stamp"
}

selected=("$@")
matrix_start=$SECONDS
for entry in "${MATRIX[@]}"; do
  read -r name python django kind <<<"$entry"
  if [ ${#selected[@]} -gt 0 ] && [[ " ${selected[*]} " != *" $name "* ]]; then
    continue
  fi
  start=$SECONDS
  build "$name" "$python" "$django" "$kind"
  versions=$(".venv-$name/bin/python" -c \
    'import django, platform; print(f"Python {platform.python_version()}, Django {django.__version__}")')
  echo "-- $name: $versions (venv ready in $((SECONDS - start))s)"
  if [ "$kind" = wide ]; then
    # The suite on SQLite without the process-heavy files (WIDE_SKIP: what they prove does
    # not change with Django's version), then the ledger's own SQL on PostgreSQL.
    skip=()
    for file in "${WIDE_SKIP[@]}"; do skip+=(--ignore "$file"); done
    TASKGUARD_SCHEDULER_TEST_SECONDS=10 TASKGUARD_TEST_DB=sqlite ".venv-$name/bin/python" \
      -m pytest -q -p no:cacheprovider -m "not soak and not once" "${skip[@]}"
    TASKGUARD_TEST_DB=postgres ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider \
      "${WIDE_POSTGRES[@]}"
    echo "-- $name: the wide pass (SQLite, then the ledger on PostgreSQL) passed in $((SECONDS - start))s"
  elif [ "$kind" = aps4 ]; then
    TASKGUARD_TEST_DB=sqlite ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider \
      tests/test_apscheduler4.py
    echo "-- $name: APScheduler 4 ($APSCHEDULER4) passed in $((SECONDS - start))s"
  else
    # The race on both databases; the whole smoke set on PostgreSQL (CI time).
    TASKGUARD_TEST_DB=sqlite ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider tests/test_race.py
    TASKGUARD_TEST_DB=postgres ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider "${SMOKE[@]}"
    echo "-- $name: the race on SQLite, the smoke set on PostgreSQL, passed in $((SECONDS - start))s"
  fi
done
echo "-- version matrix done in $((SECONDS - matrix_start))s"
