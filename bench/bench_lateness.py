"""What the late-start rule and the lateness histogram cost (PostgreSQL, or MariaDB's
statement shape on PostgreSQL's data is not measured here).

A script, not a test.

    python bench/bench_lateness.py [--schedules 10000] [--runs 30]

Creates the database ``taskguard_bench_lateness`` (``TASKGUARD_PG_HOST``/``PORT``/``USER``
as for the tests), stores ``--schedules`` every-minute schedules with ``--runs`` runs each
(one a minute, started 0 to 59 s after their slot), then prints the median wall time of
``health.check()`` and of ``ledger.window_summary`` (24 h) with and without lateness, and
the plan of the health facts statement with the late-start probe. Drops the database.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.admin_site import configure_admin_site  # noqa: E402

DB = "taskguard_bench_lateness"
PG = {
    "HOST": os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
    "PORT": os.environ.get("TASKGUARD_PG_PORT", "5432"),
    "USER": os.environ.get("TASKGUARD_PG_USER", "postgres"),
}
urlpatterns: list[object] = []


def admin_database(sql: str) -> None:
    import psycopg

    conninfo = {"host": PG["HOST"], "port": PG["PORT"], "user": PG["USER"]}
    with psycopg.connect(dbname="postgres", autocommit=True, **conninfo) as conn:
        conn.execute(sql)


def seed(schedules: int, runs: int) -> None:
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO taskguard_taskschedule (task_name, source, function, cron, cron_day_or,
                every, time_zone, default_zone, catchup, grace, max_catchup, paused,
                paused_reason, first_seen, last_seen, entry, declared_in, target_kind, args,
                kwargs, enabled, description, version, owed)
            SELECT 'bench.late.' || s, 'function', 'bench.late.' || s, '', true,
                   interval '1 minute', '', 'UTC', 'latest', interval '1 minute', 10, false,
                   '', now() - interval '2 days', now(), '', '', '', '[]', '{{}}', true, '', 0,
                   '[]'
            FROM generate_series(0, {schedules} - 1) AS s
            """
        )
        cursor.execute(
            f"""
            INSERT INTO taskguard_taskrun (task_name, slot, state, attempt, fence, owner,
                created_at, started_at, finished_at, error, duplicates)
            SELECT 'bench.late.' || s,
                   date_trunc('minute', now()) - make_interval(mins => m - 2),
                   'succeeded', 1, s * {runs} + m, 'bench:1:0:aa', now(),
                   date_trunc('minute', now()) - make_interval(mins => m - 2)
                       + make_interval(secs => (s + m) % 60),
                   date_trunc('minute', now()) - make_interval(mins => m - 2)
                       + make_interval(secs => (s + m) % 60 + 1),
                   '', 0
            FROM generate_series(0, {schedules} - 1) AS s, generate_series(0, {runs} - 1) AS m
            """
        )
        cursor.execute("ANALYZE taskguard_taskrun")
        cursor.execute("ANALYZE taskguard_taskschedule")


def wall(call: Callable[[], object], times: int = 5) -> float:
    call()
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=30)
    given = parser.parse_args()
    admin_database(f"DROP DATABASE IF EXISTS {DB}")
    admin_database(f"CREATE DATABASE {DB}")
    try:
        configure_admin_site(
            {"ENGINE": "django.db.backends.postgresql", "NAME": DB, **PG}, urlpatterns, __name__
        )
        measure(given.schedules, given.runs)
    finally:
        from django.db import connections

        connections.close_all()
        admin_database(f"DROP DATABASE IF EXISTS {DB}")


def measure(schedules: int, runs: int) -> None:
    from datetime import timedelta

    from django.test import override_settings
    from django.utils import timezone

    from django_taskguard import health, ledger
    from django_taskguard.metrics import DURATION_BUCKETS, LATENESS_BUCKETS

    seed(schedules, runs)
    print(f"{schedules} schedules x {runs} runs, PostgreSQL")
    bound = override_settings(TASKGUARD={"BACKEND": "database", "LATE_START_SECONDS": 30})
    plain, late = [], []
    for _ in range(3):  # interleaved: the machine's load moves
        plain.append(wall(health.check, 3))
        with bound:
            late.append(wall(health.check, 3))
    plain, late = statistics.median(plain), statistics.median(late)
    with bound:
        verdict = health.check()
    print(
        f"health.check without a bound: {plain:.0f} ms; with LATE_START_SECONDS=30: {late:.0f} ms"
    )
    print(f"  tasks judged late: {sum(1 for t in verdict.tasks if not t.healthy)}")
    since = timezone.now() - timedelta(hours=24)
    durations, both = [], []
    for _ in range(3):
        durations.append(wall(lambda: ledger.window_summary(since, DURATION_BUCKETS), 3))
        both.append(
            wall(lambda: ledger.window_summary(since, DURATION_BUCKETS, LATENESS_BUCKETS), 3)
        )
    durations, both = statistics.median(durations), statistics.median(both)
    print(f"window_summary durations only: {durations:.0f} ms; with lateness: {both:.0f} ms")
    late_plan = explain(health.check, bound, "CAST(MIN(e.l)")
    print("task_facts with the late-start probe (EXPLAIN ANALYZE): its subplan and total:")
    subplans = [n for n, line in enumerate(late_plan) if "SubPlan" in line]
    for line in late_plan[subplans[-1] :]:
        print("  " + line)
    plain_plan = explain(health.check, nullcontext(), "r.lease_until <=")
    print(f"  top: {late_plan[0]}")
    print(f"task_facts without it: top: {plain_plan[0]}")
    print(
        "  "
        + "; ".join(
            line.strip() for line in plain_plan if "Execution Time" in line or "Timing:" in line
        )
    )


def explain(call: Callable[[], object], context: Any, marker: str) -> list[str]:
    """EXPLAIN ANALYZE of the statement ``call`` runs that contains ``marker``."""
    from django.db import connection

    seen: list[tuple[str, Any]] = []

    def keep(execute: Any, sql: str, params: Any, many: bool, given: Any) -> Any:
        if "unnest" in sql and marker in sql:
            seen.append((sql, params))
        return execute(sql, params, many, given)

    with context, connection.execute_wrapper(keep):
        call()
    statement, params = seen[0]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params)
        return [row[0] for row in cursor.fetchall()]


if __name__ == "__main__":
    main()
