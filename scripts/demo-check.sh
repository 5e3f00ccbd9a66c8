#!/usr/bin/env bash
# What a new user types first, in a fresh clone of the committed HEAD with its own .venv:
# the README's two demo commands, `make demo` (SQLite, no Redis; make installs the package
# alone) and `REDIS_URL=redis://.../0 make demo` (the Redis fast path; make adds [redis]),
# then docs/celery.md's quick start as written (its install line, migrate, two workers and
# two beats on a Redis broker) until a beat slot has run. Redis is a private redis-server
# on a free port, never a Redis already running here; what the docs put in /tmp goes in a
# temporary directory, and createsuperuser/runserver (interactive) are left out. Each step
# runs without the caller's settings for the example project (REDIS_URL, CELERY_BROKER_URL,
# EXAMPLE_DB, DJANGO_SETTINGS_MODULE, PYTHONPATH): only what the step itself sets. Called by
# scripts/test.sh; runs on its own too (`bash scripts/demo-check.sh`; no stdin needed).
# Leaves nothing behind: every process it started is stopped (TERM, then KILL after a bound).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SCRUB=(env -u REDIS_URL -u CELERY_BROKER_URL -u EXAMPLE_DB -u DJANGO_SETTINGS_MODULE -u PYTHONPATH)

detach=()  # each long-running process leads its own process group, so stop() reaches its children
if command -v setsid >/dev/null; then detach=(setsid); fi

work=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-demo.XXXXXX")
redis_pid=
celery_pids=()

alive() {  # alive PID: running (a zombie not yet reaped is not)
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) && [ "${stat:0:1}" != Z ]
}

stop() {  # stop SECONDS PID...: TERM each (its process group when it leads one), KILL after SECONDS
  local bound=$1 pid left
  shift
  for pid in "$@"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq $((bound * 10))); do
    left=
    for pid in "$@"; do alive "$pid" && left=1; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for pid in "$@"; do kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

cleanup() {
  if [ "${#celery_pids[@]}" -gt 0 ]; then stop 20 "${celery_pids[@]}"; fi
  if [ -n "$redis_pid" ]; then stop 10 "$redis_pid"; fi  # gone before its --dir is removed
  rm -rf "$work"
}
trap cleanup EXIT

echo "-- a private redis-server"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${detach[@]}" redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$work" --logfile "$work/redis.log" </dev/null >"$work/redis.out" 2>&1 &
redis_pid=$!
answered=
for _ in $(seq 100); do
  if redis-cli -p "$port" ping >/dev/null 2>&1; then answered=1; break; fi
  alive "$redis_pid" || break
  sleep 0.1
done
if [ -z "$answered" ]; then
  echo "demo-check: redis-server on port $port never answered; its output and redis.log:" >&2
  cat "$work/redis.out" "$work/redis.log" >&2 2>/dev/null || true
  exit 1
fi

git clone -q "$ROOT" "$work/repo"
cd "$work/repo"

echo "-- make demo"
"${SCRUB[@]}" make --no-print-directory demo </dev/null >"$work/plain.log" 2>&1 \
  || { cat "$work/plain.log"; exit 1; }
grep -q "backend: database" "$work/plain.log" || { cat "$work/plain.log"; exit 1; }
# The install says nothing of its own: a setuptools warning here is what a new user reads
# first (the editable-install one came from the layout pyproject.toml did not declare).
if grep -qE "BuildBackendWarning|SetuptoolsDeprecationWarning|SetuptoolsWarning" "$work/plain.log"; then
  echo "demo-check: make demo printed a setuptools warning:" >&2
  cat "$work/plain.log" >&2
  exit 1
fi
tail -n 2 "$work/plain.log"

echo "-- REDIS_URL=redis://127.0.0.1:<private port>/0 make demo"
"${SCRUB[@]}" REDIS_URL="redis://127.0.0.1:$port/0" make --no-print-directory demo </dev/null \
  >"$work/redis-demo.log" 2>&1 || { cat "$work/redis-demo.log"; exit 1; }
grep -q "backend: redis" "$work/redis-demo.log" || { cat "$work/redis-demo.log"; exit 1; }
tail -n 2 "$work/redis-demo.log"

echo "-- docs/celery.md's quick start: two workers and two beats on a Redis broker"
.venv/bin/python -m pip install -q -e ".[redis,celery]" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
cd example_project
QUICK_START=("${SCRUB[@]}" REDIS_URL="redis://127.0.0.1:$port/0" CELERY_BROKER_URL="redis://127.0.0.1:$port/1")
"${QUICK_START[@]}" ../.venv/bin/python manage.py migrate -v 0 </dev/null
for n in 1 2; do
  "${detach[@]}" "${QUICK_START[@]}" ../.venv/bin/celery -A example worker -n "w$n@%h" -c 2 --loglevel INFO \
    </dev/null >"$work/worker$n.log" 2>&1 &
  celery_pids+=($!)
done
for n in 1 2; do
  "${detach[@]}" "${QUICK_START[@]}" ../.venv/bin/celery -A example beat -s "$work/beat$n" \
    </dev/null >"$work/beat$n.log" 2>&1 &
  celery_pids+=($!)
done
ran=
for _ in $(seq 90); do
  ran=$("${QUICK_START[@]}" ../.venv/bin/python manage.py shell -v 0 -c '
from django_taskguard.models import TaskRun
print(TaskRun.objects.filter(task_name__startswith="example.tasks.heartbeat", state="succeeded").count())' </dev/null)
  [ "$ran" -gt 0 ] && break
  for pid in "${celery_pids[@]}"; do alive "$pid" || ran=dead; done
  [ "$ran" = dead ] && break
  sleep 1
done
if [ "$ran" = dead ] || [ "$ran" -eq 0 ]; then
  tail -n 20 "$work"/worker*.log "$work"/beat*.log
  echo "demo-check: the Celery quick start ran no heartbeat slot" >&2
  exit 1
fi
echo "   a heartbeat slot succeeded ($ran so far)"
echo "demo-check: OK"
