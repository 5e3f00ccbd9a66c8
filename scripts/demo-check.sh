#!/usr/bin/env bash
# What a new user types first, in a fresh clone of the committed HEAD with its own .venv:
# the README's two demo commands, `make demo` (SQLite, no Redis; make installs the package
# alone) and `REDIS_URL=redis://.../0 make demo` (the Redis fast path; make adds [redis]),
# then docs/celery.md's quick start as written (its install line, migrate, two workers and
# two beats on a Redis broker) until a beat slot has run. Redis is a private redis-server
# on a free port, never a Redis already running here; what the docs put in /tmp goes in a
# temporary directory, and createsuperuser/runserver (interactive) are left out. Called by
# scripts/test.sh; runs on its own too (`bash scripts/demo-check.sh`). Leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

work=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-demo.XXXXXX")
redis_pid=
celery_pids=()
cleanup() {
  for pid in "${celery_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${celery_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

git clone -q "$ROOT" "$work/repo"
cd "$work/repo"

echo "-- make demo"
make --no-print-directory demo >"$work/plain.log" 2>&1 || { cat "$work/plain.log"; exit 1; }
tail -n 2 "$work/plain.log"

echo "-- REDIS_URL=redis://127.0.0.1:<private port>/0 make demo"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$work" --logfile "$work/redis.log" &
redis_pid=$!
for _ in $(seq 100); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
REDIS_URL="redis://127.0.0.1:$port/0" make --no-print-directory demo >"$work/redis-demo.log" 2>&1 \
  || { cat "$work/redis-demo.log"; exit 1; }
grep -q "backend: redis" "$work/redis-demo.log" || { cat "$work/redis-demo.log"; exit 1; }
tail -n 2 "$work/redis-demo.log"

echo "-- docs/celery.md's quick start: two workers and two beats on a Redis broker"
.venv/bin/python -m pip install -q -e ".[redis,celery]" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
cd example_project
export REDIS_URL="redis://127.0.0.1:$port/0" CELERY_BROKER_URL="redis://127.0.0.1:$port/1"
../.venv/bin/python manage.py migrate -v 0
for n in 1 2; do
  ../.venv/bin/celery -A example worker -n "w$n@%h" -c 2 --loglevel INFO >"$work/worker$n.log" 2>&1 &
  celery_pids+=($!)
done
for n in 1 2; do
  ../.venv/bin/celery -A example beat -s "$work/beat$n" >"$work/beat$n.log" 2>&1 &
  celery_pids+=($!)
done
ran=
for _ in $(seq 90); do
  ran=$(../.venv/bin/python manage.py shell -v 0 -c '
from django_taskguard.models import TaskRun
print(TaskRun.objects.filter(task_name__startswith="example.tasks.heartbeat", state="succeeded").count())')
  [ "$ran" -gt 0 ] && break
  for pid in "${celery_pids[@]}"; do kill -0 "$pid" 2>/dev/null || ran=dead; done
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
