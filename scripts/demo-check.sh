#!/usr/bin/env bash
# The README's two demo commands, as a new user types them in a fresh clone: `make demo`
# (SQLite, no Redis) and `REDIS_URL=redis://.../0 make demo` (the Redis fast path). The
# clone is of the committed HEAD and gets its own .venv (make installs the package alone,
# then adds [redis]); the Redis run talks to a private redis-server on a free port, never
# to a Redis already running here. Called by scripts/test.sh; runs on its own too
# (`bash scripts/demo-check.sh`). Leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

work=$(mktemp -d "${TMPDIR:-/tmp}/taskguard-demo.XXXXXX")
redis_pid=
cleanup() {
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
echo "demo-check: OK"
