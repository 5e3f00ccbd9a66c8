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

# What each entry runs is said by the tests' markers (tests/support/selection.py), not by
# lists of paths here. The wide pass: every test that may run beside others (not
# "serial": processes, signals and servers, the browser, timing; what they prove does not
# change with Django's version, and the main passes run them), on SQLite and on PostgreSQL,
# each with pytest-xdist. It keeps everything that touches Django: the ORM and migrations,
# the admin, checks, settings, django.tasks (Django's own on 6.x), async, the test kit, the
# commands. The smoke set (marker "smoke"): 8 real processes racing for 200 slots, the
# migrations check, an admin page rendered, the Celery beat scheduler stamping a slot and a
# task recording it, a guarded call on the Redis backend (django-redis differs across Django
# versions), a slot carried by a django.tasks task, guarded coroutine functions (asyncio
# differs across Python versions).


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
    for database in sqlite postgres; do
      TASKGUARD_SCHEDULER_TEST_SECONDS=10 TASKGUARD_TEST_DB=$database ".venv-$name/bin/python" \
        -m pytest -q -p no:cacheprovider -n 2 -m "not soak and not serial"
    done
    echo "-- $name: the wide pass (SQLite, then PostgreSQL) passed in $((SECONDS - start))s"
  elif [ "$kind" = aps4 ]; then
    TASKGUARD_TEST_DB=sqlite ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider \
      tests/test_apscheduler4.py
    echo "-- $name: APScheduler 4 ($APSCHEDULER4) passed in $((SECONDS - start))s"
  else
    # Only the files that hold a smoke test are collected: the smoke venvs lack the extras
    # (sentry-sdk, prometheus-client, ...) that other test files import.
    mapfile -t smoke_files < <(grep -l "pytest.mark.smoke" tests/test_*.py)
    for database in sqlite postgres; do
      TASKGUARD_TEST_DB=$database ".venv-$name/bin/python" -m pytest -q -p no:cacheprovider \
        -m smoke "${smoke_files[@]}"
    done
    echo "-- $name: the smoke set on SQLite and PostgreSQL passed in $((SECONDS - start))s"
  fi
done
echo "-- version matrix done in $((SECONDS - matrix_start))s"
