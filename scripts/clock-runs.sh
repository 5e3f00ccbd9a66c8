#!/usr/bin/env bash
# The SQLite pass at other dates and in another zone: proof that no test depends on today's
# date or on the host's zone. Four runs, each the SQLite pass of scripts/test.sh (the tests
# that may run beside each other, then the serial ones):
#   - the clock at 2027-03-07 23:59:30, a week before the US spring-forward (the EU's is 03-28)
#   - the clock at 2027-10-24 23:59:30, a week before the EU fall-back (the US's is 11-07)
#   - the clock at 2028-02-28 23:59:30, the day before a leap day, crossing midnight
#   - TZ=America/Los_Angeles (west of UTC), today's clock
# The date is moved with libfaketime (Debian's faketime; installed when missing), starting at
# the given time and ticking from there, in the test process and every child it starts; the
# private redis-server processes keep the real clock (redis-server does not start under
# libfaketime; tests/support/redis_server.py). Needs gcc for the sleep shim
# (scripts/clock-runs-sleep.c). Not part of `make test` (each run takes about as long as its
# SQLite pass, over CI's budget): run it by hand, `bash scripts/clock-runs.sh [NAME...]`
# (names: spring, fall, leap, west), after `make test` built .venv (or with PY=another python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

if ! command -v faketime >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq faketime >/dev/null
fi
shim_dir=$(mktemp -d)
trap 'rm -rf "$shim_dir"' EXIT
gcc -shared -fPIC -O2 -o "$shim_dir/sleep.so" scripts/clock-runs-sleep.c -ldl

declare -A AT=(
  [spring]="2027-03-07 23:59:30"
  [fall]="2027-10-24 23:59:30"
  [leap]="2028-02-28 23:59:30"
  [west]=""
)
names=("$@")
if [ ${#names[@]} -eq 0 ]; then names=(spring fall leap west); fi
results=()
for name in "${names[@]}"; do
  [ -n "${AT[$name]+set}" ] || { echo "unknown run: $name (spring, fall, leap, west)" >&2; exit 2; }
  prefix=()
  zone=()
  if [ "$name" = west ]; then
    zone=(env TZ=America/Los_Angeles)
  else
    # The wall clock moved, the monotonic clock left real: Python's timed waits (a lock's or
    # a Condition's timeout, a thread's join) go to the kernel against the real one through
    # sem_clockwait, which libfaketime does not intercept, and under a faked one they waited
    # for good. Its sleeps go through the shim (scripts/clock-runs-sleep.c). A child
    # continues its parent's faked clock (FAKETIME_DONT_RESET) rather than starting again
    # at the given time, so that the test process and the workers it starts agree.
    prefix=(env LD_PRELOAD="$shim_dir/sleep.so" FAKETIME_DONT_FAKE_MONOTONIC=1
      FAKETIME_DONT_RESET=1 faketime -f "@${AT[$name]}")
  fi
  echo "== $name: ${AT[$name]:-TZ=America/Los_Angeles}"
  start=$SECONDS
  status=0
  # Both parts run whatever the first's outcome: a run reports every test that fails there.
  TASKGUARD_SCHEDULER_TEST_SECONDS=10 "${zone[@]}" "${prefix[@]}" $PY -m pytest -q \
    -p no:cacheprovider -n 2 -m "not soak and not serial" || status=$?
  TASKGUARD_SCHEDULER_TEST_SECONDS=10 "${zone[@]}" "${prefix[@]}" $PY -m pytest -q \
    -p no:cacheprovider -n 2 -m "not soak and serial" || status=$?
  results+=("$(printf '%-7s %-22s exit %d in %ds' "$name" "${AT[$name]:-TZ=America/Los_Angeles}" "$status" $((SECONDS - start)))")
done
printf '%s\n' "${results[@]}"
for line in "${results[@]}"; do
  [[ "$line" == *"exit 0 "* ]] || exit 1
done
