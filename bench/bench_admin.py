"""Admin, overview, health, metrics, cleanup and prune on a 1,000,000-row ledger (PostgreSQL).

A script, not a test.

    python bench/bench_admin.py [--rows 1000000] [--keep]

Creates the database ``taskguard_bench`` (``TASKGUARD_BENCH_DB`` to rename;
``TASKGUARD_PG_HOST``/``PORT``/``USER`` as for the tests), seeds it with one
``INSERT ... SELECT generate_series`` per table, prints the figures, and drops
the database unless ``--keep``. It never touches the test suites' databases.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.admin_site import configure_admin_site  # noqa: E402

DB = os.environ.get("TASKGUARD_BENCH_DB", "taskguard_bench")
PG = {
    "HOST": os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
    "PORT": os.environ.get("TASKGUARD_PG_PORT", "5432"),
    "USER": os.environ.get("TASKGUARD_PG_USER", "postgres"),
}
TASKS = 50
STALE = 1000
LIVE = 100
urlpatterns: list[object] = []


def configure() -> None:
    configure_admin_site(
        {"ENGINE": "django.db.backends.postgresql", "NAME": DB, **PG}, urlpatterns, __name__
    )


def admin_database(sql: str) -> None:
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, **_conninfo()) as conn:
        conn.execute(sql)


def _conninfo() -> dict[str, str]:
    return {"host": PG["HOST"], "port": PG["PORT"], "user": PG["USER"]}


SEEDED_AT: list[datetime] = []


def seed(rows: int) -> float:
    """One INSERT ... SELECT per table: the oldest 90% finished, stale and live runs recent."""
    from django.db import connection

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        SEEDED_AT.append(cursor.fetchone()[0])
        cursor.execute(
            f"""
            INSERT INTO taskguard_taskrun (task_name, slot, state, attempt, fence, owner,
                created_at, started_at, lease_until, finished_at, error, duplicates)
            SELECT 'bench.task' || (g % {TASKS}),
                   now() - make_interval(mins => {rows} - g),
                   CASE WHEN g >= {rows} - {STALE + LIVE} THEN 'running'
                        WHEN g % 97 = 0 THEN 'failed'
                        WHEN g % 89 = 0 THEN 'skipped'
                        ELSE 'succeeded' END,
                   1, g, 'host-' || (g % 7) || ':' || (1000 + g % 5000) || ':' || md5(g::text),
                   now() - make_interval(mins => {rows} - g),
                   now() - make_interval(mins => {rows} - g),
                   CASE WHEN g >= {rows} - {LIVE} THEN now() + interval '1 hour'
                        ELSE now() - make_interval(mins => {rows} - g) + interval '30 seconds'
                        END,
                   CASE WHEN g >= {rows} - {STALE + LIVE} THEN NULL
                        ELSE now() - make_interval(mins => {rows} - g) + interval '2 seconds'
                        END,
                   '', g % 3
            FROM generate_series(0, {rows} - 1) AS g
            """
        )
        cursor.execute(
            """
            INSERT INTO taskguard_taskruntransition (run_id, from_state, to_state, at, reason,
                owner)
            SELECT id, 'pending', 'running', started_at, 'claimed', owner FROM taskguard_taskrun
            UNION ALL
            SELECT id, 'running', state, finished_at, 'returned', owner FROM taskguard_taskrun
            WHERE state <> 'running'
            """
        )
        cursor.execute(f"SELECT setval('taskguard_fence', {rows} + 1)")
        cursor.execute("ANALYZE taskguard_taskrun")
        cursor.execute("ANALYZE taskguard_taskruntransition")
    return time.perf_counter() - started


def time_page(
    client: object,
    params: dict[str, str],
    repeat: int = 5,
    url: str = "/admin/taskguard/taskrun/",
    statuses: tuple[int, ...] = (200,),
) -> tuple[float, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url, params)  # type: ignore[attr-defined]  # warm
    timings = []
    queries = 0
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            response = client.get(url, params)  # type: ignore[attr-defined]
            timings.append(time.perf_counter() - started)
        assert response.status_code in statuses, response.status_code
        queries = len(captured.captured_queries)
        full = [q["sql"] for q in captured.captured_queries
                if "COUNT(" in q["sql"].upper() and "WHERE" not in q["sql"].upper()]  # fmt: skip
        assert not full, f"a full COUNT(*) ran: {full}"
    return statistics.median(timings) * 1000, queries


def bench_admin() -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    if not User.objects.filter(username="bench").exists():
        User.objects.create_superuser("bench", "bench@example.com", "pw")
    client = Client()
    client.force_login(User.objects.get(username="bench"))
    cases = {
        "changelist (default)": {},
        "changelist ?state=failed": {"state": "failed"},
        "changelist ?state=running": {"state": "running"},
        "changelist ?task_name=bench.task7": {"task_name": "bench.task7"},
        "changelist ?slot__year=<last year>": {"slot__year": str(time.gmtime().tm_year - 1)},
    }
    for label, params in cases.items():
        ms, queries = time_page(client, params)
        print(f"{label:42s} {ms:8.1f} ms  {queries:3d} queries (median of 5)")


def register_schedules() -> None:
    """One registered schedule per seeded task (every 50 minutes, as the seed's slots fall)."""
    from datetime import timedelta

    from django_taskguard.models import TaskSchedule

    TaskSchedule.objects.bulk_create(
        TaskSchedule(
            task_name=f"bench.task{n}",
            function=f"bench.task{n}",
            every=timedelta(minutes=TASKS),
            grace=timedelta(minutes=1),
            max_catchup=10,
            first_seen=SEEDED_AT[0] - timedelta(days=365),
        )
        for n in range(TASKS)
    )


def bench_monitoring() -> None:
    """The overview page, health/ and metrics/ with one schedule per task (50 tasks)."""
    from django.contrib.auth.models import User
    from django.test import Client

    client = Client()
    client.force_login(User.objects.get(username="bench"))
    cases = {
        "overview (50 tasks x 30 slots)": ("/admin/taskguard/taskrun/overview/", (200,)),
        "health/ (50 tasks)": ("/taskguard/health/", (200, 503)),
        "metrics/ (50 tasks, 24 h window)": ("/taskguard/metrics/", (200,)),
    }
    for label, (url, statuses) in cases.items():
        ms, queries = time_page(client, {}, url=url, statuses=statuses)
        print(f"{label:42s} {ms:8.1f} ms  {queries:3d} queries (median of 5)")
    database_time(client, "/admin/taskguard/taskrun/overview/")
    database_time(client, "/taskguard/metrics/")


def database_time(client: object, url: str) -> None:
    """The page's statements run again under EXPLAIN ANALYZE: the database's own time for
    them (planning + execution), which the machine's load does not blur as much."""
    import json

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        client.get(url)  # type: ignore[attr-defined]
    total = 0.0
    worst = (0.0, "")
    for query in captured.captured_queries:
        if not query["sql"].lstrip().upper().startswith(("SELECT", "WITH")):
            continue
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query["sql"])
            plan = cursor.fetchone()[0]
        plan = plan if isinstance(plan, list) else json.loads(plan)
        spent = plan[0]["Planning Time"] + plan[0]["Execution Time"]
        total += spent
        worst = max(worst, (spent, query["sql"][:60]))
    print(
        f"  {url}: {len(captured.captured_queries)} statements, {total:.1f} ms in PostgreSQL "
        f"(EXPLAIN ANALYZE; slowest {worst[0]:.1f} ms: {worst[1]}...)"
    )


def bench_cleanup() -> None:
    from django_taskguard.cleanup import cleanup_locks

    tracemalloc.start()
    started = time.perf_counter()
    result = cleanup_locks()
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"cleanup_locks: abandoned {result.stale_runs} stale runs in {elapsed:.2f} s, "
        f"peak Python memory {peak / 1024:.0f} KiB"
    )
    assert result.stale_runs == STALE, result


def bench_prune(rows: int) -> None:
    from datetime import timedelta

    from django_taskguard.retention import prune_runs

    # Exactly the oldest 90% of the slots (slot = seed time - (rows - g) minutes).
    before = SEEDED_AT[0] - timedelta(minutes=rows - rows * 9 // 10)
    started = time.perf_counter()
    result = prune_runs(before, batch_size=1000)
    elapsed = time.perf_counter() - started
    print(
        f"prune_runs: deleted {result.runs} runs and {result.transitions} transitions in "
        f"{elapsed:.1f} s, {result.batches} batches, longest transaction "
        f"{result.longest_batch_seconds * 1000:.0f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    args = parser.parse_args()
    admin_database(f"DROP DATABASE IF EXISTS {DB}")
    admin_database(f"CREATE DATABASE {DB}")
    try:
        configure()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        print(f"seeded {args.rows} runs (+ transitions) in {seed(args.rows):.1f} s")
        bench_admin()
        register_schedules()
        bench_monitoring()
        bench_cleanup()
        bench_prune(args.rows)
        bench_admin()
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            admin_database(f"DROP DATABASE IF EXISTS {DB}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
