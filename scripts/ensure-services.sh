#!/usr/bin/env bash
# Make sure what the test suite needs is on this machine: a running PostgreSQL,
# the redis-server binary (the suite starts its own private servers on free
# ports and never touches a running Redis), a running RabbitMQ on
# 127.0.0.1:5672 with the guest user (the Celery e2e test makes, and deletes,
# its own vhost on it), Chromium for the admin's browser test, and MariaDB's
# server binaries (the MariaDB pass starts a private mariadbd in a temporary
# directory; no service is started) with the headers mysqlclient builds against.
# Installs only what is missing and starts only what is stopped; needs root.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v pg_ctlcluster >/dev/null 2>&1 || command -v pg_isready >/dev/null 2>&1 \
  || missing+=(postgresql)
command -v rabbitmqctl >/dev/null 2>&1 || missing+=(rabbitmq-server)
# mariadb-server-core: mariadbd and mariadb-install-db; mariadb-client: the client and
# mariadb-tzinfo-to-sql (found in /usr/sbin too: root's PATH may not have it).
command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server-core)
command -v mariadb-tzinfo-to-sql >/dev/null 2>&1 || missing+=(mariadb-client)
pkg-config --exists libmariadb 2>/dev/null || missing+=(libmariadb-dev pkg-config)

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

rabbitmq_listening() {
  timeout 2 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672' 2>/dev/null
}
if ! rabbitmq_listening; then
  echo "starting RabbitMQ"
  # No systemd in CI containers: the init script, else the server's own daemon mode.
  service rabbitmq-server start >/dev/null 2>&1 || rabbitmq-server -detached >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do rabbitmq_listening && break; sleep 1; done
fi
if ! rabbitmq_listening; then
  echo "RabbitMQ does not answer on 127.0.0.1:5672 (see /var/log/rabbitmq/); the" \
    "Celery e2e tests need it" >&2
  exit 1
fi
echo "RabbitMQ answers on 127.0.0.1:5672"
