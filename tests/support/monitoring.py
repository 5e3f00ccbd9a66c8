"""Schedules and runs for the health, metrics and overview tests."""

from __future__ import annotations

import io
from datetime import datetime, timedelta

from django.core.management import CommandError, call_command
from django.utils import timezone

from django_taskguard.ledger import upkeep as upkeep_store
from django_taskguard.models import RunState, TaskRun, TaskSchedule
from django_taskguard.schedules import IntervalSchedule

DAY = timedelta(days=1)
GRACE = timedelta(minutes=1)


def schedule(
    task: str,
    *,
    every: timedelta = DAY,
    cron: str = "",
    first_seen: datetime | None = None,
    paused: bool = False,
    paused_at: datetime | None = None,
    grace: timedelta = GRACE,
) -> TaskSchedule:
    """A registered schedule (first seen a week ago unless said)."""
    return TaskSchedule.objects.create(
        task_name=task,
        function=task,
        cron=cron,
        every=None if cron else every,
        grace=grace,
        max_catchup=10,
        paused=paused,
        paused_at=(paused_at or timezone.now()) if paused else None,
        paused_reason="paused by admin ops" if paused else "",
        first_seen=first_seen or timezone.now() - timedelta(days=7),
    )


def due_slot(every: timedelta = DAY, grace: timedelta = GRACE) -> datetime:
    """The latest slot of an ``every`` interval due past ``grace``, by this clock."""
    return IntervalSchedule(every).latest_slot(timezone.now() - grace)


def finished(
    task: str,
    slot: datetime,
    state: str = RunState.SUCCEEDED,
    *,
    seconds: float = 2.0,
    duplicates: int = 0,
    attempt: int = 1,
) -> TaskRun:
    """A finished run of ``task`` at ``slot`` that ran for ``seconds``."""
    started = slot + timedelta(seconds=1)
    return TaskRun.objects.create(
        task_name=task,
        slot=slot,
        state=state,
        attempt=attempt,
        owner="worker-1:17:0:aa01" if attempt else "",
        started_at=started if attempt else None,
        finished_at=started + timedelta(seconds=seconds),
        duplicates=duplicates,
    )


def upkeep_ran() -> None:
    """Record an upkeep that ran just now and found nothing to do (the test's rows come
    after it), as ``cleanup_locks`` records its run: without it, the verdict of a database
    with schedules says that upkeep has never run (tests/test_upkeep.py)."""
    assert upkeep_store.take("tests", timedelta(seconds=60), timedelta(0))
    assert upkeep_store.finish("tests", {"stale_runs": 0}, "")


def run_check(*args: str) -> tuple[int, str]:
    """``manage.py check_schedules ARGS``: (exit status, output)."""
    out = io.StringIO()
    try:
        call_command("check_schedules", *args, stdout=out)
    except CommandError as exc:
        return exc.returncode, out.getvalue() + str(exc)
    return 0, out.getvalue()
