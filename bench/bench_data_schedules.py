"""100,000 data schedules, 10,000 due in the same second: PostgreSQL + Redis. A script,
not a test.

    python bench/bench_data_schedules.py [--schedules 100000] [--herd 10000]
                                         [--sizes 1000,100000] [--copies 3] [--no-fire]

Creates a scratch PostgreSQL database (``taskguard_bench_data_<pid>``, dropped at the end;
``TASKGUARD_PG_HOST/PORT/USER``) and starts a private redis-server on a free port. For
each of ``--sizes`` it defines that many data schedules of one guarded target (a few with
``define_schedule``, the rest in bulk with ``ledger.schedules.define_many``): a tenth of them
(``--herd`` at the largest size) ``* * * * *`` in UTC, due in the same second every minute,
the others daily in four time zones at an hour that does not come during the bench. Then
it prints, for each read, its statements (``CaptureQueriesContext``) and seconds:

- the missed-slot sweep: the first one (every schedule new), one with nothing due, and one
  a minute later when the herd's slot is past its grace with nothing run (all of it missed);
- ``health.check()`` (and whether it judged every schedule), the metrics scrape, the
  admin's overview page and its schedule list (paginated).

Then (unless ``--no-fire``), at the largest size, it runs ``--copies`` ``run_schedules``
processes until two herd slots have passed: every due slot executed exactly once (the
target appends ``TASK SLOT PID TIME`` to a log file with O_APPEND: counted outside the
ledger), none missed, lateness (start minus slot) p50/p99/max, each copy's resident memory
(VmRSS from /proc) and its start time (process start to its first execution, and to its
first fire of the herd).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bench_schedules import start_redis  # noqa: E402

DB_NAME = f"taskguard_bench_data_{os.getpid()}"
TARGET = "bench_data_jobs.tenant_report"
ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Tokyo"]
GRACE = timedelta(seconds=30)

SETTINGS = """
USE_TZ = True
TIME_ZONE = "UTC"
SECRET_KEY = "bench"
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = ["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
    "django.contrib.sessions", "django.contrib.messages", "django_taskguard"]
MIDDLEWARE = ["django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware"]
ROOT_URLCONF = "bench_data_urls"
TEMPLATES = [{{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
    "OPTIONS": {{"context_processors": ["django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages"]}}}}]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {db!r},
    "USER": {user!r}, "HOST": {host!r}, "PORT": {port!r}, "CONN_MAX_AGE": None,
}}}}
CACHES = {{"default": {{
    "BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:{redis}/0",
}}}}
TASKGUARD = {{"BACKEND": "redis", "SCHEDULE_MODULES": ["bench_data_jobs"],
    "UPKEEP_INTERVAL_SECONDS": None}}
LOGGING = {{"version": 1, "disable_existing_loggers": False,
    "formatters": {{"at": {{"format": "%(created).3f %(process)d %(levelname)s %(message)s"}}}},
    "handlers": {{"errors": {{"class": "logging.StreamHandler", "level": "INFO",
                              "formatter": "at"}}}},
    "loggers": {{"taskguard": {{"handlers": ["errors"], "level": "INFO",
                                "propagate": False}}}}}}
"""

URLS = """
from django.contrib import admin
from django.urls import include, path
urlpatterns = [path("admin/", admin.site.urls),
               path("taskguard/", include("django_taskguard.urls"))]
"""

JOBS = """
import os, time
from django_taskguard import current_run, once_per_schedule

LOG = os.environ.get("BENCH_LOG", "")

@once_per_schedule()
def tenant_report(tenant_id):
    started = time.time()
    if LOG:
        run = current_run()
        line = f"{run.task_name} {run.slot.timestamp():.0f} {os.getpid()} {started:.6f}\\n"
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
"""


def conninfo(dbname: str) -> str:
    return (
        f"host={os.environ.get('TASKGUARD_PG_HOST', '127.0.0.1')} "
        f"port={os.environ.get('TASKGUARD_PG_PORT', '5432')} "
        f"user={os.environ.get('TASKGUARD_PG_USER', 'postgres')} dbname={dbname}"
    )


def scratch_database(create: bool) -> None:
    import psycopg

    with psycopg.connect(conninfo("postgres"), autocommit=True) as conn:
        if create:
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
        else:
            conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')


def measured(label: str, call: Callable[[], Any]) -> Any:
    """Run ``call`` once; print its statements and seconds; return its result."""
    from django.db import connections

    statements = 0

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        nonlocal statements
        statements += 1
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(count):
        started = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - started
    print(f"  {label:<44} {statements:6d} statements {seconds:8.2f} s")
    return result


def define(count: int, herd: int) -> float:
    """``count`` data schedules, ``herd`` of them every minute; returns the seconds taken."""
    from django_taskguard import define_schedule
    from django_taskguard.data_schedules import grace_of, validate
    from django_taskguard.ledger import schedules as store
    from django_taskguard.models import ScheduleEventOrigin

    started = time.perf_counter()
    now = datetime.now(dt_timezone.utc)
    quiet_hour = {zone: (now + timedelta(hours=12)).astimezone(_zone(zone)).hour for zone in ZONES}

    def definition(n: int) -> dict[str, Any]:
        if n < herd:
            return {"cron": "* * * * *", "time_zone": "UTC"}
        zone = ZONES[n % len(ZONES)]
        return {"cron": f"{n % 60} {quiet_hour[zone]} * * *", "time_zone": zone}

    few = min(10, count)
    for n in range(few):  # through the documented API, one transaction each
        define_schedule(
            f"tenant-{n}", TARGET, kwargs={"tenant_id": n}, grace=GRACE, **definition(n)
        )
    batch: list[tuple[str, dict[str, object]]] = []
    for n in range(few, count):
        batch.append(
            validate(f"tenant-{n}", TARGET, kwargs={"tenant_id": n}, grace=GRACE, **definition(n))
        )
        if len(batch) == 5_000 or n == count - 1:
            store.define_many(batch, origin=ScheduleEventOrigin.CODE, grace_of=grace_of, by="bench")
            batch = []
    return time.perf_counter() - started


def _zone(name: str) -> Any:
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


def reset() -> None:
    import psycopg

    with psycopg.connect(conninfo(DB_NAME), autocommit=True) as conn:
        conn.execute(
            "TRUNCATE taskguard_taskruntransition, taskguard_taskrun, taskguard_taskschedule, "
            "taskguard_scheduleevent"
        )
        conn.execute("VACUUM ANALYZE")


def parts(count: int, herd: int) -> None:
    """Statements and seconds of the sweep, health, metrics, overview, admin list."""
    from django.contrib.auth.models import User
    from django.test import Client

    from django_taskguard import health, ledger, metrics
    from django_taskguard.ledger import upkeep
    from django_taskguard.missed import sweep_missed
    from django_taskguard.models import TaskSchedule

    reset()
    seconds = define(count, herd)
    print(f"{count:,} data schedules ({herd:,} every minute), defined in {seconds:.1f} s")
    assert TaskSchedule.objects.count() == count
    import psycopg

    with psycopg.connect(conninfo(DB_NAME), autocommit=True) as conn:
        conn.execute("ANALYZE")
    now = ledger.database_now()
    first = now - timedelta(seconds=5)
    TaskSchedule.objects.update(first_seen=first)  # all first seen 5 s ago (not as defined)
    from django_taskguard.data_firing import DataSchedules

    data = DataSchedules()
    measured("run_schedules: load every data schedule", lambda: data.load(now, start=True))
    quiet = now + timedelta(seconds=1)
    while any(data.due(quiet)):  # past what is due now: a tick with nothing due
        quiet += timedelta(seconds=1)
    measured(
        "run_schedules: 1,000 ticks with nothing due",
        lambda: [data.due(quiet) for _ in range(1000)],
    )
    time.sleep(2.1)  # a poll reads the database every DATA_POLL_SECONDS
    measured("run_schedules: a poll of the changes", lambda: data.poll(quiet))
    measured("sweep, the first (every schedule new)", lambda: sweep_missed(now=now))
    measured("sweep, nothing due", lambda: sweep_missed(now=now + timedelta(seconds=5)))
    later = now + timedelta(seconds=60) + GRACE
    result = measured("sweep, the herd's slot past its grace", lambda: sweep_missed(now=later))
    minutes = int((later - GRACE).timestamp()) // 60 - int(first.timestamp()) // 60
    print(
        f"    ... recorded {result.missed_slots:,} missed slots (expected {herd * minutes:,}: "
        f"{minutes} minute(s) of the herd)"
    )
    measured(
        "sweep after that, nothing due", lambda: sweep_missed(now=later + timedelta(seconds=1))
    )
    with psycopg.connect(conninfo(DB_NAME), autocommit=True) as conn:
        conn.execute("ANALYZE")  # what autovacuum does after the herd's new rows
    assert upkeep.take("bench", timedelta(seconds=60), timedelta(0))
    assert upkeep.finish("bench", {}, "")
    verdict = measured("health.check()", health.check)
    judged = sum(1 for task in verdict.tasks if task.registered)
    print(f"    ... judged {judged:,} schedules, {len(verdict.unhealthy):,} unhealthy (missed)")
    measured("metrics scrape", lambda: metrics.exposition("text/plain"))
    if not User.objects.filter(username="bench").exists():
        User.objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(User.objects.get(username="bench"))
    page = measured("admin overview page", lambda: client.get("/admin/taskguard/taskrun/overview/"))
    assert page.status_code == 200, page.status_code
    page = measured(
        "admin schedule list (page 1)", lambda: client.get("/admin/taskguard/taskschedule/")
    )
    assert page.status_code == 200, page.status_code
    page = measured(
        "admin schedule list (page 50)", lambda: client.get("/admin/taskguard/taskschedule/?p=50")
    )
    assert page.status_code in (200, 302), page.status_code


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fire(count: int, herd: int, copies: int, directory: Path, env: dict[str, str]) -> None:
    """``copies`` run_schedules processes until two herd slots have passed."""
    from django_taskguard.models import RunState, TaskRun, TaskSchedule

    reset()
    define(count, herd)
    # Nothing before now fires (else each copy starts with the herd's slot of the minute
    # the defining took: a catch-up of 10,000 slots beside the first herd).
    TaskSchedule.objects.update(first_seen=datetime.now(dt_timezone.utc))
    log = directory / "executions.log"
    env = {**env, "BENCH_LOG": str(log)}
    out = (directory / "copies.out").open("wb")
    started_at = time.time()
    # Start ~25 s before a minute so that each copy is up when the herd falls due.
    wait = (60 - started_at % 60 - 25) % 60
    time.sleep(wait)
    launched = []
    processes = []
    for _ in range(copies):
        launched.append(time.time())
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "django", "run_schedules", "--max-workers", "8"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
    first_herd = (int(launched[-1]) // 60 + 1) * 60
    herds = [first_herd, first_herd + 60]
    rss: dict[int, int] = {}
    deadline = herds[-1] + 70
    while time.time() < deadline:
        for process in processes:
            if process.poll() is None:
                rss[process.pid] = max(rss.get(process.pid, 0), vm_rss_kib(process.pid))
        time.sleep(1)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        process.wait(timeout=120)
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    runs = [(task, int(slot), int(pid), float(at)) for task, slot, pid, at in lines]
    counts = Counter((task, slot) for task, slot, _, _ in runs if slot in herds)
    others = sum(1 for _, slot, _, _ in runs if slot not in herds)
    expected = herd * len(herds)
    twice = sum(1 for n in counts.values() if n > 1)
    lateness = sorted(at - slot for _, slot, _, at in runs if slot in herds)
    missed = TaskRun.objects.filter(state=RunState.MISSED, slot__gte=_utc(herds[0])).count()
    print(f"run_schedules x{copies}, {count:,} schedules, herds at {herds} (Unix seconds)")
    print(f"  executed   {len(counts):8,d} of {expected:,} due slots; twice {twice}; "
          f"never {expected - len(counts):,}; missed rows {missed:,}; "
          f"other slots executed {others:,}")  # fmt: skip
    if lateness:
        p99 = lateness[max(0, int(len(lateness) * 0.99) - 1)]
        print(f"  lateness   p50 {statistics.median(lateness):.2f} s  p99 {p99:.2f} s  "
              f"max {lateness[-1]:.2f} s")  # fmt: skip
        for slot in herds:
            of = [at for _, s, _, at in runs if s == slot]
            if of:
                print(f"  herd {slot}: all {len(of):,} started within {max(of) - slot:.2f} s")
    logged = (directory / "copies.out").read_text(errors="replace").splitlines()
    for process, launch in zip(processes, launched, strict=True):
        mine = sorted(at for _, _, pid, at in runs if pid == process.pid)
        first = f"{mine[0] - launch:.1f} s" if mine else "never"
        ready = [
            float(line.split()[0])
            for line in logged
            if line.split()[1:2] == [str(process.pid)] and "data schedules" in line
        ]
        up = f"{ready[0] - launch:.1f} s" if ready else "?"
        print(f"  copy {process.pid}: VmRSS max {rss.get(process.pid, 0) / 1024:.0f} MiB, "
              f"data schedules loaded {up} after its start, first execution {first}, "
              f"{len(mine):,} executions")  # fmt: skip
    warnings = [line for line in logged if " INFO " not in line]
    if warnings:
        print(f"  the copies wrote {len(warnings)} log lines; the first ones:")
        print("\n".join(f"    {line}" for line in warnings[:8]))


def _utc(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, dt_timezone.utc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--herd", type=int, default=10_000)
    parser.add_argument("--sizes", default="1000,100000")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--no-fire", action="store_true")
    parser.add_argument(
        "--keep", action="store_true", help="leave the scratch database (and print its name)"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",") if size]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # drop the scratch database
    directory = Path(tempfile.mkdtemp(prefix="taskguard-bench-data-"))
    redis, redis_port = start_redis(str(directory))
    scratch_database(create=True)
    try:
        (directory / "bench_data_settings.py").write_text(
            SETTINGS.format(
                db=DB_NAME,
                user=os.environ.get("TASKGUARD_PG_USER", "postgres"),
                host=os.environ.get("TASKGUARD_PG_HOST", "127.0.0.1"),
                port=os.environ.get("TASKGUARD_PG_PORT", "5432"),
                redis=redis_port,
            )
        )
        (directory / "bench_data_urls.py").write_text(URLS)
        (directory / "bench_data_jobs.py").write_text(JOBS)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)]),
            "DJANGO_SETTINGS_MODULE": "bench_data_settings",
        }
        sys.path.insert(0, str(directory))
        os.environ["DJANGO_SETTINGS_MODULE"] = "bench_data_settings"
        import django
        from django.core.management import call_command

        django.setup()
        logging.getLogger("taskguard").setLevel(logging.ERROR)  # a warning per missed schedule
        call_command("migrate", verbosity=0)
        for size in sizes:
            parts(size, max(1, size // 10) if size < args.schedules else args.herd)
        if not args.no_fire:
            fire(args.schedules, args.herd, args.copies, directory, env)
    finally:
        from django.db import connections

        connections.close_all()
        if args.keep:
            print(f"kept database {DB_NAME}; settings in {directory}")
        else:
            scratch_database(create=False)
        redis.terminate()
        redis.wait(timeout=10)
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
