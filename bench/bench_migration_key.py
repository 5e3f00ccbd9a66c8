"""Measure migration 0008_taskrun_key on a big ledger (a script, not a test).

    python bench/bench_migration_key.py [--rows 1000000]

Creates a scratch PostgreSQL database (``taskguard_bench_migration`` on
127.0.0.1:5432 as user postgres; ``TASKGUARD_PG_HOST/PORT/USER`` to point
elsewhere), migrates taskguard to the migration before 0007, fills the ledger
with ``--rows`` finished runs, then applies 0007 while

- a sampler records every lock the migrating connection holds or waits for
  on the run table (``pg_locks``, every 5 ms), and
- a writer keeps inserting and updating runs (as claims and finishes do) and
  records its slowest statement: a write blocked behind the migration shows
  there.

Prints the migration's wall time, the lock modes seen, the writer's statement
count and slowest statement, and whether the table was rewritten (its
relfilenode changed). The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NAME = "taskguard_bench_migration"
TABLE = "taskguard_taskrun"


def dsn(database: str) -> dict[str, str]:
    return {
        "dbname": database,
        "user": os.environ.get("TASKGUARD_PG_USER", "postgres"),
        "host": os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
        "port": os.environ.get("TASKGUARD_PG_PORT", "5432"),
    }


def admin(statement: str) -> None:
    import psycopg

    with psycopg.connect(**dsn("postgres"), autocommit=True) as connection:
        connection.execute(statement)


def configure() -> None:
    import django
    from django.conf import settings

    settings.configure(
        USE_TZ=True,
        TIME_ZONE="UTC",
        INSTALLED_APPS=["django_taskguard"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": NAME,
                "USER": dsn(NAME)["user"],
                "HOST": dsn(NAME)["host"],
                "PORT": dsn(NAME)["port"],
            }
        },
        LOGGING_CONFIG=None,
    )
    django.setup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    admin(f"DROP DATABASE IF EXISTS {NAME}")
    admin(f"CREATE DATABASE {NAME}")
    try:
        configure()
        run(args.rows)
    finally:
        from django.db import connections

        connections.close_all()
        admin(f"DROP DATABASE IF EXISTS {NAME} WITH (FORCE)")


def run(rows: int) -> None:
    import psycopg
    from django.core.management import call_command
    from django.db import connection
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(connection)
    node = loader.graph.node_map[("taskguard", "0008_taskrun_key")]
    (before,) = [parent.key[1] for parent in node.parents if parent.key[0] == "taskguard"]
    call_command("migrate", "taskguard", before, verbosity=0)
    with psycopg.connect(**dsn(NAME), autocommit=True) as filler:
        began = time.perf_counter()
        filler.execute(
            f"INSERT INTO {TABLE} (task_name, slot, state, attempt, fence, owner, created_at, "
            "started_at, finished_at, lease_until, error, duplicates) "
            "SELECT 'bench.task.' || (n %% 50), now() - make_interval(secs => n), "
            "'succeeded', 1, n, "
            "'host:1:pid:' || md5(n::text), now(), now(), now(), now(), '', 0 "
            "FROM generate_series(1, %s) AS n",
            (rows,),
        )
        filler.execute(f"VACUUM ANALYZE {TABLE}")
        filled = time.perf_counter() - began
        size = filler.execute(
            f"SELECT pg_size_pretty(pg_total_relation_size('{TABLE}'))"
        ).fetchone()
        node_before = filler.execute(f"SELECT pg_relation_filenode('{TABLE}')").fetchone()
    print(f"{rows} rows filled in {filled:.1f} s; table with indexes: {size[0] if size else '?'}")

    pid = connection.cursor().connection.info.backend_pid  # the migrating connection
    stop = threading.Event()
    modes: dict[str, int] = {}
    writes: list[float] = []

    def sample() -> None:
        with psycopg.connect(**dsn(NAME), autocommit=True) as watcher:
            while not stop.is_set():
                for mode, granted in watcher.execute(
                    "SELECT mode, granted FROM pg_locks WHERE pid = %s AND relation = %s::regclass",
                    (pid, TABLE),
                ):
                    name = mode if granted else f"{mode} (waiting)"
                    modes[name] = modes.get(name, 0) + 1
                time.sleep(0.005)

    def write() -> None:
        with psycopg.connect(**dsn(NAME), autocommit=True) as writer:
            n = 0
            while not stop.is_set():
                n += 1
                began = time.perf_counter()
                writer.execute(
                    f"INSERT INTO {TABLE} (task_name, slot, state, attempt, owner, created_at, "
                    "error, duplicates) VALUES ('bench.writer', now() + make_interval(secs => %s), "
                    "'running', 1, 'w', now(), '', 0)",
                    (n,),
                )
                writer.execute(
                    f"UPDATE {TABLE} SET state = 'succeeded' WHERE task_name = 'bench.writer' "
                    "AND state = 'running'"
                )
                writes.append(time.perf_counter() - began)

    threads = [threading.Thread(target=sample), threading.Thread(target=write)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    began = time.perf_counter()
    call_command("migrate", "taskguard", "0008_taskrun_key", verbosity=0)
    took = time.perf_counter() - began
    time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join()
    with psycopg.connect(**dsn(NAME), autocommit=True) as checker:
        node_after = checker.execute(f"SELECT pg_relation_filenode('{TABLE}')").fetchone()
        valid = checker.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'taskguard_run_task_key'::regclass"
        ).fetchone()
    print(f"0008_taskrun_key applied in {took:.2f} s")
    print(f"locks the migrating connection held on {TABLE}: {sorted(modes)}")
    print(
        f"a concurrent writer made {len(writes)} insert+update pairs; slowest "
        f"{max(writes) * 1000:.1f} ms, median {sorted(writes)[len(writes) // 2] * 1000:.2f} ms"
    )
    rewritten = node_before != node_after
    print(f"table rewritten: {'yes' if rewritten else 'no'}; index valid: {valid and valid[0]}")


if __name__ == "__main__":
    main()
