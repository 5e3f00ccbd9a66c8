"""Benchmark the guarded call against its floor (a script, not a test).

    python bench/bench_guard.py [--rounds 2000] [--database mariadb] [--prepare-threshold 5]

Starts a private redis-server on a free loopback port, uses PostgreSQL
(``TASKGUARD_BENCH_DB``, default database ``test`` on 127.0.0.1:5432 as user
postgres; ``TASKGUARD_PG_HOST/PORT/USER`` to point elsewhere), or with
``--database mariadb`` a private MariaDB server it starts on a free port (as the
tests do), creates the taskguard tables there if needed, and times in one process:

- floor: ``SET NX PX`` + Lua compare-and-delete + ``INSERT ... ON CONFLICT DO
  NOTHING`` (MariaDB: ``INSERT IGNORE``) + ``UPDATE`` on the raw redis-py client and
  the raw driver cursor, on the same database as the guarded calls;
- an unguarded call of the same function;
- a guarded winning call (a fresh slot each time);
- a guarded call that loses to a live winner (a new slot each time, its key
  held by someone else);
- a guarded call that comes after its slot finished (a new slot each time,
  its key holding the finished-slot marker);
- the same three for ``@once_per_key`` (a fresh key each time: winner; key held by
  someone else; key holding the finished marker);
- one Redis ``PING`` with redis-py, and one on a bare socket (no client library).

``--prepare-threshold N`` sets PostgreSQL's ``OPTIONS["prepare_threshold"]`` (Django's
default: None, nothing prepared), which lets the guarded calls' hot statements be
prepared by the server; the floor's raw cursor binds on the client either way.

Before timing, it checks with Django's ``CaptureQueriesContext`` that both
losing calls (and both keyed ones) make no database query. Prints medians, p99 and
three ratios, and the same three for keyed calls:
winner/floor (bar 1.5), loser to a live winner/PING and loser to a finished
slot/PING (bar 1.5 each; the PING made with redis-py, the client everyone's
code uses), plus the losers/bare PING for scale.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process, port
        except OSError:
            time.sleep(0.05)
    process.kill()
    sys.exit("redis-server did not start")


def database(kind: str, prepare_threshold: int | None = None) -> dict[str, object]:
    if kind == "mariadb":
        from tests.support import mariadb_server  # a private server, stopped when this exits

        port = mariadb_server.port()
        with socket.create_connection(("127.0.0.1", port)):
            pass
        subprocess.run(
            ["mariadb", "--no-defaults", "-uroot", "-h127.0.0.1", f"-P{port}", "-e",
             "CREATE DATABASE IF NOT EXISTS bench CHARACTER SET utf8mb4"],
            check=True,
        )  # fmt: skip
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": "bench",
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "OPTIONS": {"charset": "utf8mb4"},
            "CONN_MAX_AGE": None,
        }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("TASKGUARD_BENCH_DB", "test"),
        "USER": os.environ.get("TASKGUARD_PG_USER", "postgres"),
        "HOST": os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("TASKGUARD_PG_PORT", "5432"),
        "CONN_MAX_AGE": None,
        "OPTIONS": {} if prepare_threshold is None else {"prepare_threshold": prepare_threshold},
    }


def configure(port: int, kind: str, prepare_threshold: int | None = None) -> None:
    import django
    from django.conf import settings

    settings.configure(
        USE_TZ=True,
        TIME_ZONE="UTC",
        INSTALLED_APPS=["django_taskguard"],
        DATABASES={"default": database(kind, prepare_threshold)},
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{port}/0",
            }
        },
        # No automatic upkeep: its thread (a sweep once a minute) beside the timed calls
        # would be measured too; the calls' own cost of it (a clock read) stays.
        TASKGUARD={"BACKEND": "redis", "LEASE_SECONDS": 30, "UPKEEP_INTERVAL_SECONDS": None},
        LOGGING_CONFIG=None,
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", "taskguard", verbosity=0)


def timed(calls: dict[str, Callable[[int], object]], rounds: int) -> dict[str, list[float]]:
    """Time every call once per round, in a fresh random order each round.

    Interleaving makes machine noise hit every call alike; the shuffle makes
    what ran just before (a warm Redis after a Redis call, a sleeping one
    after a database-bound call) the same for every call. In a fixed order
    the PING always followed a Redis call and the loser always followed a
    winner, which by itself made the loser look 1.5 to 2 times slower.
    """
    order = random.Random(20261121)
    names = list(calls)
    for i in range(50):
        for call in calls.values():
            call(-1 - i)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    clock = time.perf_counter
    for i in range(rounds):
        order.shuffle(names)
        for name in names:
            call = calls[name]
            began = clock()
            call(i)
            samples[name].append(clock() - began)
    return samples


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(len(samples) * 0.99) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--database", choices=["postgresql", "mariadb"], default="postgresql")
    parser.add_argument("--prepare-threshold", type=int, default=None)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="taskguard-bench-")
    server, port = start_redis(directory)
    try:
        configure(port, args.database, args.prepare_threshold)
        run(args.rounds, port)
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def run(rounds: int, port: int) -> None:
    import redis
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from django_taskguard import once_per_key, once_per_schedule
    from django_taskguard.locks import Acquired, run_key
    from django_taskguard.locks.keys import claim_key
    from django_taskguard.locks.redis import RedisLock
    from django_taskguard.locks.redis_scripts import RELEASE
    from django_taskguard.models import TaskRun

    tag = uuid.uuid4().hex[:8]
    # Recent slots: guarded calls refuse (and record) slots older than PRUNE_AFTER_DAYS.
    base = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(days=3)

    def slot(i: int) -> datetime:
        return base + timedelta(seconds=i + 100)  # warm-up rounds use i = -1 ... -50

    raw = redis.Redis(port=port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    connection.ensure_connection()
    cursor = connection.connection.cursor()  # the driver's raw cursor (autocommit)
    table = TaskRun._meta.db_table

    mariadb = connection.vendor == "mysql"
    now = "UTC_TIMESTAMP(6)" if mariadb else "now()"
    insert = "INSERT IGNORE INTO" if mariadb else "INSERT INTO"
    ignore = "" if mariadb else " ON CONFLICT DO NOTHING"

    def floor(i: int) -> None:
        key, token = run_key("bench", f"floor.{tag}", slot(i)), uuid.uuid4().hex
        at = connection.ops.adapt_datetimefield_value(base + timedelta(seconds=i))
        raw.set(key, token, nx=True, px=30000)
        cursor.execute(
            f"{insert} {table} (task_name, slot, state, attempt, owner, created_at, error, "
            f"duplicates) VALUES (%s, %s, 'running', 1, %s, {now}, '', 0){ignore}",
            (f"bench.floor.{tag}", at, token),
        )
        cursor.execute(
            f"UPDATE {table} SET state = 'succeeded', finished_at = {now} "
            "WHERE task_name = %s AND slot = %s",
            (f"bench.floor.{tag}", at),
        )
        raw.evalsha(RELEASE.sha, 2, key, claim_key(key), token)

    raw.script_load(RELEASE.source)

    def work() -> int:
        return 1

    guarded = once_per_schedule(name=f"bench.guarded.{tag}")(work)
    losing = once_per_schedule(name=f"bench.losing.{tag}")(work)
    late = once_per_schedule(name=f"bench.late.{tag}")(work)
    # The losers meet a new slot every round, as in production (no warm key caches):
    # each one held by someone else, or finished (its key holds the marker).
    lock = RedisLock.for_alias("default")
    for i in range(-52, rounds):
        lock.acquire(lock.key(losing.task_name or "", slot(i)), "0" * 32, 3600)
        finished = lock.key(late.task_name or "", slot(i))
        assert lock.acquire(finished, "f" * 32, 3600) is Acquired.WON
        lock.finish(finished, "f" * 32)

    # The same for keyed calls: a new key every round (key = the round number).
    def keyed_work(i: int) -> int:
        return 1

    keyed = once_per_key(key="order:{i}", name=f"bench.keyed.{tag}")(keyed_work)
    keyed_losing = once_per_key(key="order:{i}", name=f"bench.keyed_losing.{tag}")(keyed_work)
    keyed_late = once_per_key(key="order:{i}", name=f"bench.keyed_late.{tag}")(keyed_work)
    for i in range(-52, rounds):
        lock.acquire(lock.keyed(f"bench.keyed_losing.{tag}", f"order:{i}"), "0" * 32, 3600)
        finished = lock.keyed(f"bench.keyed_late.{tag}", f"order:{i}")
        assert lock.acquire(finished, "f" * 32, 3600) is Acquired.WON
        lock.finish(finished, "f" * 32)
    # Every loser: one Redis round trip, no database query (the bar's condition).
    for name, lose in (
        ("losing", lambda: losing.run_for_slot(slot(-52))),
        ("late", lambda: late.run_for_slot(slot(-52))),
        ("keyed losing", lambda: keyed_losing(-52)),
        ("keyed late", lambda: keyed_late(-52)),
    ):
        with CaptureQueriesContext(connection) as queries:
            assert lose() is None
        assert len(queries) == 0, f"{name} queried: {queries.captured_queries}"

    # One round trip with no client library at all, for scale.
    bare = socket.create_connection(("127.0.0.1", port))
    bare.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def bare_ping(i: int) -> None:
        bare.sendall(b"*1\r\n$4\r\nPING\r\n")
        reply = b""
        while not reply.endswith(b"\r\n"):
            reply += bare.recv(16)

    results = timed(
        {
            "PING": lambda i: raw.ping(),
            "PING, bare socket": bare_ping,
            "unguarded call": lambda i: work(),
            "floor": floor,
            "guarded winner": lambda i: guarded.run_for_slot(slot(i) + timedelta(days=1)),
            "loser, live winner": lambda i: losing.run_for_slot(slot(i)),
            "loser, finished": lambda i: late.run_for_slot(slot(i)),
            "keyed winner": lambda i: keyed(i),
            "keyed loser, live": lambda i: keyed_losing(i),
            "keyed loser, done": lambda i: keyed_late(i),
        },
        rounds,
    )
    name = connection.settings_dict["NAME"]
    kind = f"MariaDB {connection.mysql_version}" if mariadb else "PostgreSQL"  # type: ignore[attr-defined]
    threshold = connection.settings_dict["OPTIONS"].get("prepare_threshold")
    print(
        f"{rounds} interleaved rounds; loopback Redis :{port}, {kind} database {name}, "
        f"prepare_threshold {threshold}"
    )
    for name, samples in results.items():
        print(
            f"  {name:19} median {statistics.median(samples) * 1e6:9.1f} us   "
            f"p99 {p99(samples) * 1e6:9.1f} us"
        )
    med = {name: statistics.median(samples) for name, samples in results.items()}
    ping, bare_ping_ = med["PING"], med["PING, bare socket"]
    live, done = med["loser, live winner"], med["loser, finished"]
    print(f"winner/floor           = {med['guarded winner'] / med['floor']:.2f}  (bar 1.5)")
    print(f"loser to a live winner = {live / ping:.2f} x PING  (bar 1.5; redis-py's PING)")
    print(f"loser to a finished    = {done / ping:.2f} x PING  (bar 1.5; 0 queries, checked)")
    print(
        f"for scale, x a bare-socket PING: live {live / bare_ping_:.2f}, "
        f"finished {done / bare_ping_:.2f}"
    )
    k_live, k_done = med["keyed loser, live"], med["keyed loser, done"]
    print(f"keyed winner/floor     = {med['keyed winner'] / med['floor']:.2f}  (bar 1.5)")
    print(f"keyed loser, live      = {k_live / ping:.2f} x PING  (bar 1.5; 0 queries, checked)")
    print(f"keyed loser, finished  = {k_done / ping:.2f} x PING  (bar 1.5; 0 queries, checked)")
    bare.close()
    TaskRun.objects.filter(task_name__endswith=tag).delete()
    raw.close()


if __name__ == "__main__":
    main()
