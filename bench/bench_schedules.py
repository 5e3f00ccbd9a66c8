"""K one-second schedules, three ``run_schedules`` copies, PostgreSQL + Redis. A script, not a test.

    python bench/bench_schedules.py [--schedules 300] [--seconds 30] [--copies 3]
                                    [--max-workers 8] [--backend redis|database]
                                    [--cron "* * * * *"]

Starts a private redis-server, uses PostgreSQL database ``taskguard_bench_schedules``
(created if missing; ``TASKGUARD_PG_HOST/PORT/USER``), writes a settings module and a
module of K ``@once_per_schedule(every=1s)`` functions (``--cron``: ``cron=`` that
expression, in UTC; give ``--seconds`` room for a few of its slots) into a temporary directory, and
runs ``--copies`` ``manage.py run_schedules`` processes for ``--seconds``. Every body
appends ``TASK SLOT START`` to one file with O_APPEND (executions counted outside the
ledger). Then it reports, over the slots due after a warm-up of 5 s and before the stop:

- slots per second sustained (slots executed / seconds of the window) and the offered
  rate (K per second);
- every slot once: slots run twice (must be 0), slots never run, ``missed`` rows;
- lateness (body start minus nominal slot time): median, p99, max;
- CPU seconds used by the copies, PostgreSQL and Redis (from /proc), per slot.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = os.environ.get("TASKGUARD_BENCH_DB", "taskguard_bench_schedules")
WARMUP = 5.0


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


SETTINGS = """
USE_TZ = True
TIME_ZONE = "UTC"
SECRET_KEY = "bench"
INSTALLED_APPS = ["django_taskguard"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {db!r},
    "USER": {user!r}, "HOST": {host!r}, "PORT": {port!r}, "CONN_MAX_AGE": None,
}}}}
CACHES = {{"default": {{
    "BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:{redis}/0",
}}}}
TASKGUARD = {{"BACKEND": {backend!r}, "SCHEDULE_MODULES": ["bench_jobs"]}}
LOGGING = {{"version": 1, "disable_existing_loggers": False,
    "handlers": {{"null": {{"class": "logging.NullHandler"}},
                  "errors": {{"class": "logging.StreamHandler", "level": "WARNING"}}}},
    "loggers": {{"taskguard": {{"handlers": ["null", "errors"], "level": "INFO",
                                "propagate": False}}}}}}
"""

JOBS = """
import os, time
from datetime import timedelta
from django_taskguard import current_run, once_per_schedule

LOG = os.environ["BENCH_LOG"]

def make(n):
    @once_per_schedule({schedule}, name=f"bench.{{n}}")
    def job():
        started = time.time()
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            line = f"{{n}} {{current_run().slot.timestamp():.0f}} {{started:.6f}}\\n"
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    return job

JOBS = [make(n) for n in range({schedules})]
"""


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def postgres_cpu() -> float:
    """CPU seconds of PostgreSQL: its live processes, plus what its exited backends used
    (counted in the postmaster's children's time once reaped)."""
    found = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True)
    pids = [int(pid) for pid in found.stdout.split()]
    total = cpu_seconds(pids)
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) not in pids:  # the postmaster: its parent is not postgres
            total += (int(fields[13]) + int(fields[14])) / tick
    return total


def prepare_database(env: dict[str, str]) -> None:
    import psycopg

    conninfo = (
        f"host={os.environ.get('TASKGUARD_PG_HOST', '127.0.0.1')} "
        f"port={os.environ.get('TASKGUARD_PG_PORT', '5432')} "
        f"user={os.environ.get('TASKGUARD_PG_USER', 'postgres')}"
    )
    with psycopg.connect(f"{conninfo} dbname=postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DB_NAME]).fetchone():
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    manage = [sys.executable, "-m", "django"]
    subprocess.run([*manage, "migrate", "taskguard", "-v", "0"], env=env, check=True)
    with psycopg.connect(f"{conninfo} dbname={DB_NAME}", autocommit=True) as conn:
        conn.execute(
            "TRUNCATE taskguard_taskruntransition, taskguard_taskrun, taskguard_taskschedule"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--backend", default="redis", choices=("redis", "database"))
    parser.add_argument("--no-batch", action="store_true", help="run_schedules --no-batch")
    parser.add_argument("--cron", help='cron schedules (e.g. "* * * * *") instead of every=1s')
    args = parser.parse_args()

    directory = tempfile.mkdtemp(prefix="taskguard-bench-schedules-")
    redis, redis_port = start_redis(directory)
    try:
        run(args, Path(directory), redis.pid, redis_port)
    finally:
        redis.terminate()
        redis.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, directory: Path, redis_pid: int, redis_port: int) -> None:
    (directory / "bench_settings.py").write_text(
        SETTINGS.format(
            db=DB_NAME,
            user=os.environ.get("TASKGUARD_PG_USER", "postgres"),
            host=os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
            port=os.environ.get("TASKGUARD_PG_PORT", "5432"),
            redis=redis_port,
            backend=args.backend,
        )
    )
    schedule = f"cron={args.cron!r}" if args.cron else "every=timedelta(seconds=1)"
    (directory / "bench_jobs.py").write_text(
        JOBS.format(schedules=args.schedules, schedule=schedule)
    )
    log = directory / "executions.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "bench_settings",
        "BENCH_LOG": str(log),
    }
    prepare_database(env)
    out = (directory / "copies.out").open("wb")
    began = time.time()
    copies = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "run_schedules",
                "--max-workers",
                str(args.max_workers),
                "--sweep-every",
                "10",
                *(["--no-batch"] if args.no_batch else []),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        for _ in range(args.copies)
    ]
    pids = [copy.pid for copy in copies]
    pg_before = postgres_cpu()
    redis_before = cpu_seconds([redis_pid])
    time.sleep(args.seconds)
    copies_cpu = cpu_seconds(pids)
    pg_cpu = postgres_cpu() - pg_before
    redis_cpu = cpu_seconds([redis_pid]) - redis_before
    stopped = time.time()
    for copy in copies:
        copy.send_signal(signal.SIGTERM)
    for copy in copies:
        copy.wait(timeout=120)
    warnings = (directory / "copies.out").read_text(errors="replace").splitlines()
    if warnings:
        print(f"copies wrote {len(warnings)} warning lines; the first ones:")
        print("\n".join(warnings[:8]))
    report(args, log, began + WARMUP, stopped - 2.0, copies_cpu, pg_cpu, redis_cpu, env)


def report(
    args: argparse.Namespace,
    log: Path,
    start: float,
    end: float,
    copies_cpu: float,
    pg_cpu: float,
    redis_cpu: float,
    env: dict[str, str],
) -> None:
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    runs = [(int(task), int(slot), float(started)) for task, slot, started in lines]
    window = [run for run in runs if start <= run[1] <= end]
    counts = Counter((task, slot) for task, slot, _ in window)
    first, last = int(start) + 1, int(end)
    due = fire_times(args.cron, first, last) if args.cron else list(range(first, last + 1))
    expected = {(task, slot) for task in range(args.schedules) for slot in due}
    seconds = last - first + 1
    lateness = sorted(started - slot for _, slot, started in window)
    twice = sum(1 for count in counts.values() if count > 1)
    absent = sorted(expected - set(counts), key=lambda pair: pair[1])
    never = len(absent)
    missed = count_missed(env)
    print(
        f"schedules K={args.schedules} ({args.cron or 'one-second'}), copies={args.copies}, "
        f"max_workers={args.max_workers}, backend={args.backend}, "
        f"{'one by one' if args.no_batch else 'batched'}, {seconds}s measured"
    )
    print(f"offered      {len(expected) / seconds:8.0f} slots/s")
    print(f"sustained    {len(counts) / seconds:8.0f} slots/s ({len(counts)} slots in {seconds}s)")
    print(f"run twice    {twice:8d}")
    print(f"never run    {never:8d} (of {len(expected)} due in the window)")
    if absent:
        print(
            f"             their rows: {row_states(absent)}; slots {absent[0][1]}..{absent[-1][1]}"
        )
    print(f"missed rows  {missed:8d}")
    if lateness:
        p99 = lateness[int(len(lateness) * 0.99) - 1]
        print(f"lateness     median {statistics.median(lateness):.3f}s  p99 {p99:.3f}s  "
              f"max {lateness[-1]:.3f}s")  # fmt: skip
        buckets: dict[int, list[float]] = {}
        for _, slot, started in window:
            buckets.setdefault((slot - first) // 5, []).append(started - slot)
        trend = "  ".join(
            f"{5 * b:>3}s:{sorted(v)[int(len(v) * 0.99) - 1]:.2f}"
            for b, v in sorted(buckets.items())
        )
        print(f"p99 by 5 s   {trend}  (growing: the copies fall behind)")
    total = max(len(runs), 1)
    print(f"CPU          copies {copies_cpu:.1f}s  postgres {pg_cpu:.1f}s  redis {redis_cpu:.1f}s"
          f"  ({1000 * (copies_cpu + pg_cpu + redis_cpu) / total:.2f} ms CPU per slot, "
          f"{args.copies} guarded calls per slot)")  # fmt: skip


def fire_times(expression: str, first: int, last: int) -> list[int]:
    """The UTC fire times of a cron expression in ``[first, last]`` (Unix seconds)."""
    from datetime import datetime, timezone

    from croniter import croniter

    walker = croniter(expression, datetime.fromtimestamp(first - 1, timezone.utc))
    times = []
    while (fire := int(walker.get_next(float))) <= last:
        times.append(fire)
    return times


def row_states(pairs: list[tuple[int, int]]) -> dict[str, int]:
    import psycopg

    conninfo = (
        f"host={os.environ.get('TASKGUARD_PG_HOST', '127.0.0.1')} "
        f"port={os.environ.get('TASKGUARD_PG_PORT', '5432')} "
        f"user={os.environ.get('TASKGUARD_PG_USER', 'postgres')} dbname={DB_NAME}"
    )
    states: Counter[str] = Counter()
    with psycopg.connect(conninfo) as conn:
        for task, slot in pairs:
            found = conn.execute(
                "SELECT state FROM taskguard_taskrun WHERE task_name = %s "
                "AND slot = to_timestamp(%s)",
                [f"bench.{task}", slot],
            ).fetchone()
            states[found[0] if found else "no row"] += 1
    return dict(states)


def count_missed(env: dict[str, str]) -> int:
    found = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); "
         "from django_taskguard.models import TaskRun; "
         "print(TaskRun.objects.filter(state='missed').count())"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    return int(found.stdout.strip() or -1)


if __name__ == "__main__":
    main()
