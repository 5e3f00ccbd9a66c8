"""Rows for the cleanup, retention and admin tests, written the way the ledger writes them."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

from django.utils import timezone as dj_timezone

from django_taskguard import guard
from django_taskguard.models import RunState, TaskRun, TaskRunTransition

from .slots import BASE_SLOT

BASE = BASE_SLOT
_fences = itertools.count(10_000)


def make_run(
    task: str = "tests.job",
    minute: int = 0,
    *,
    state: str = RunState.RUNNING,
    owner: str = "otherhost:1:deadbeef",
    lease: float = -3600.0,
    slot: datetime | None = None,
    transitions: int = 1,
    using: str = "default",
    pk: int | None = None,
) -> TaskRun:
    """A run of ``task`` at ``BASE + minute``; ``lease`` seconds from now (negative: expired)."""
    now = dj_timezone.now()
    running = state == RunState.RUNNING
    run = TaskRun.objects.using(using).create(
        pk=pk,
        task_name=task,
        slot=slot or BASE + timedelta(minutes=minute),
        state=state,
        attempt=1,
        fence=next(_fences),
        owner=owner,
        started_at=now - timedelta(minutes=5),
        lease_until=now + timedelta(seconds=lease) if running else None,
        finished_at=None if running or state == RunState.PENDING else now,
    )
    for index in range(transitions):
        TaskRunTransition.objects.using(using).create(
            run_id=run.pk,
            from_state=RunState.PENDING,
            to_state=RunState.RUNNING,
            reason=f"claimed {index}",
            owner=owner,
        )
    return run


class PutBack(Exception):
    """What an on_busy hook raises to have its call come back later."""


def busy_call(
    task_name: str, hints: list[float], *, slot: datetime, lease: float, raises: bool = True
) -> object:
    """A guarded call whose on_busy hook records its hint, then raises PutBack (or returns)."""

    def on_busy(seconds: float) -> None:
        hints.append(seconds)
        if raises:
            raise PutBack

    policy = guard.Policy(lease_seconds=lease)
    return guard.execute(task_name, slot, policy, lambda: "ran", (), {}, on_busy=on_busy)


def counted_duplicates(task_name: str | None = None, slot: object = None) -> int:
    """The duplicates of the (one) run, with those the lock Redis still holds folded in.

    A call that loses in Redis is counted on a claim record (one round trip);
    ``cleanup_locks`` folds those into the row. Under the database backend it
    changes nothing.
    """
    from django_taskguard.cleanup import cleanup_locks
    from django_taskguard.models import TaskRun

    cleanup_locks()
    runs = TaskRun.objects.all()
    if task_name is not None:
        runs = runs.filter(task_name=task_name)
    if slot is not None:
        runs = runs.filter(slot=slot)
    return int(runs.get().duplicates)
