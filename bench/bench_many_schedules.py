"""Health, metrics and the admin overview with many registered cron schedules (SQLite).

A script, not a test.

    python bench/bench_many_schedules.py [--schedules 2000] [--cron "*/5 * * * *"]

Creates a throwaway SQLite database in a temporary directory, stores ``--schedules``
schedules (each with a succeeded run at its latest due slot, so every task is healthy),
then prints, per read, the median CPU time of 5 calls (``time.process_time``), the share
of ``health.check`` spent rebuilding cron schedules (cProfile), and the overview page's
size. It never touches the test suites' databases.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.admin_site import configure_admin_site  # noqa: E402

urlpatterns: list[object] = []


def configure(path: Path) -> None:
    configure_admin_site(
        {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}, urlpatterns, __name__
    )


def seed(count: int, cron: str) -> None:
    from django.core.management import call_command
    from django.utils import timezone

    from django_taskguard.models import RunState, TaskRun, TaskSchedule
    from django_taskguard.schedules import CronSchedule

    call_command("migrate", verbosity=0)
    now = timezone.now()
    due = CronSchedule(cron).latest_slot(now - timedelta(minutes=1))
    names = [f"bench.cron.{n:05d}" for n in range(count)]
    TaskSchedule.objects.bulk_create(
        TaskSchedule(
            task_name=name,
            function=name,
            cron=cron,
            grace=timedelta(minutes=1),
            max_catchup=1,
            first_seen=now - timedelta(days=1),
        )
        for name in names
    )
    TaskRun.objects.bulk_create(
        TaskRun(
            task_name=name,
            slot=due,
            state=RunState.SUCCEEDED,
            attempt=1,
            fence=n + 1,
            owner="bench:1:0:aa",
            started_at=due,
            finished_at=due + timedelta(seconds=1),
        )
        for n, name in enumerate(names)
    )


def cpu(call: Callable[[], object], times: int = 5) -> float:
    """The median CPU seconds of ``times`` calls."""
    spent = []
    for _ in range(times):
        started = time.process_time()
        call()
        spent.append(time.process_time() - started)
    return statistics.median(spent)


def rebuild_share(call: Callable[[], object]) -> float:
    """The share of ``call``'s profiled time spent in CronSchedule.__post_init__."""
    profile = cProfile.Profile()
    profile.runcall(call)
    stats = pstats.Stats(profile)
    total = stats.total_tt  # type: ignore[attr-defined]
    inside = sum(
        row[3]  # cumulative time
        for (file, _, name), row in stats.stats.items()  # type: ignore[attr-defined]
        if name == "__post_init__" and file.endswith("cron.py")
    )
    return inside / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedules", type=int, default=2000)
    parser.add_argument("--cron", default="*/5 * * * *")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="taskguard-bench-") as folder:
        configure(Path(folder) / "bench.sqlite3")
        seed(args.schedules, args.cron)
        from django.contrib.auth.models import User
        from django.test import Client

        from django_taskguard import health, metrics
        from django_taskguard.ledger import upkeep

        # An upkeep ran just now (else the verdict says it never did, whatever the tasks).
        assert upkeep.take("bench", timedelta(seconds=60), timedelta(0))
        assert upkeep.finish("bench", {}, "")
        User.objects.create_superuser("bench", "bench@example.com", "bench")
        client = Client()
        client.force_login(User.objects.get(username="bench"))
        page = client.get("/admin/taskguard/taskrun/overview/")
        assert page.status_code == 200, page.status_code
        verdict = health.check()
        assert verdict.healthy, [t.task for t in verdict.unhealthy][:5]
        print(f"{args.schedules} schedules, cron {args.cron!r} (SQLite)")
        print(f"health.check: {cpu(health.check) * 1000:.0f} ms CPU (median of 5)")
        print(f"  of it in CronSchedule.__post_init__: {rebuild_share(health.check):.0%}")
        print(f"metrics scrape: {cpu(lambda: metrics.exposition('text/plain')) * 1000:.0f} ms CPU")
        overview = cpu(lambda: client.get("/admin/taskguard/taskrun/overview/"), 3)
        size = len(page.content)
        print(f"admin overview: {overview * 1000:.0f} ms CPU (median of 3), {size:,} bytes")


if __name__ == "__main__":
    main()
