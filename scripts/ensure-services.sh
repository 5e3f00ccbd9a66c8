#!/usr/bin/env bash
# Make sure what the test suite needs is on this machine: a running PostgreSQL,
# the redis-server binary (the suite starts its own private servers on free
# ports and never touches a running Redis), and Chromium for the admin's
# browser test. Installs only what is missing; needs root for apt-get.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v pg_ctlcluster >/dev/null 2>&1 || command -v pg_isready >/dev/null 2>&1 \
  || missing+=(postgresql)

if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432
