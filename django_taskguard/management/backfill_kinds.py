"""What ``manage.py backfill`` does with one slot, by the kind of schedule it backfills.

A :class:`Backfilled` says how to run a slot in the command's process through the guard
(``run``) and, when a task queue wraps the schedule's function, how to hand it to that
queue (``enqueue``): a code schedule's (:func:`of_entry`), a data schedule's with a function
or django.tasks target (:func:`of_data`: the row's arguments, its identity ``target[name]``
and version recorded on the run). Celery beat entries and Celery data schedules are sent
to their workers instead (``handoff.SENDERS``, in the command).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.management.base import CommandError

from .. import data_schedules, guard
from ..decorators import BACKFILL_KWARG, SCHEDULE_KWARG, SLOT_KWARG, backfilling, note_version
from ..exceptions import TaskGuardError
from ..handoff import hand_off, hand_out
from ..ledger import schedules as schedule_store
from ..models import ScheduleSource, TargetKind, TaskSchedule
from ..policy import Policy
from ..registry import Entry
from ..schedules import Schedule, rebuild


@dataclass(frozen=True)
class Backfilled:
    """A schedule as backfill sees it: ``run(slot, policy)`` runs the slot here through the
    guard and says whether the body ran in this call; ``enqueue(slot)`` (None: no task
    queue) hands it to the queue and says what it made; ``window`` keeps only the slots
    its schedule fires (a data schedule's ``starts``/``ends``); ``note``: said before."""

    task_name: str
    schedule: Schedule
    policy: Policy
    run: Callable[[datetime, Policy], bool]
    enqueue: Callable[[datetime], str] | None
    window: Callable[[datetime], bool] = lambda slot: True
    note: str = ""


def of_entry(entry: Entry, enqueue: bool) -> Backfilled:
    """A code schedule (``@once_per_schedule`` with a schedule)."""
    if entry.source != ScheduleSource.FUNCTION:
        raise CommandError(
            f"{entry.task_name} is a Celery task's own schedule (a beat sends it): "
            f"backfill its beat entry instead, NAME[entry] as check_schedules lists it"
        )
    if enqueue and entry.enqueue is None:
        raise CommandError(
            f"--enqueue: {entry.task_name} is not wrapped by a task queue's task (django.tasks "
            f"@task(), Huey @huey.task(), RQ @enqueue_on(queue), django-q2 on_django_q, a "
            f"Dramatiq actor: above @once_per_schedule), so there is no queue to enqueue to"
        )

    def run(slot: datetime, policy: Policy) -> bool:
        return _ran(entry.task_name, slot, policy, entry.func, (), {}, version=None)

    send = None if entry.enqueue is None else functools.partial(_hand_off, entry)
    return Backfilled(entry.task_name, entry.schedule, entry.policy, run, send)


def of_data(row: TaskSchedule, enqueue: bool) -> Backfilled:
    """A data schedule whose target runs here (a function) or on a django.tasks backend."""
    name = row.task_name
    if row.removed_at is not None:
        raise CommandError(f"{name} was deleted: define it again to backfill it")
    try:
        target = data_schedules.resolve_target(row.function)
        schedule = rebuild(row.cron, row.cron_day_or, schedule_store.zone_of(row), row.every)
    except TaskGuardError as exc:
        raise CommandError(f"{name}: its target {row.function} cannot run here: {exc}") from exc
    if enqueue and target.kind != TargetKind.DJANGO_TASKS:
        raise CommandError(
            f"--enqueue: {name}'s target {row.function} is not a django.tasks task, so there "
            f"is no backend to enqueue to; backfill it without --enqueue"
        )
    args, kwargs, version = tuple(row.args), dict(row.kwargs), row.version

    def run(slot: datetime, policy: Policy) -> bool:
        return _ran(name, slot, policy, target.guarded.body, args, kwargs, version=version)

    send = None
    if target.kind == TargetKind.DJANGO_TASKS:

        def send(slot: datetime) -> str:
            carried = {
                **kwargs,
                SLOT_KWARG: slot.isoformat(),
                SCHEDULE_KWARG: {"task_name": name, "version": version},
                BACKFILL_KWARG: True,  # an operator's: no lateness policy
            }
            made = functools.partial(_enqueue_task, target.task, args, carried)
            return hand_out(name, slot, made)

    def window(slot: datetime) -> bool:
        return (row.starts is None or slot >= row.starts) and (row.ends is None or slot <= row.ends)

    policy = data_schedules.policy_of(row, target.policy)
    note = "" if row.enabled else f"{name} is disabled: backfill runs its slots all the same."
    return Backfilled(name, schedule, policy, run, send, window, note)


def _ran(
    task_name: str,
    slot: datetime,
    policy: Policy,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    version: int | None,
) -> bool:
    """Run one slot through the guard; True when the body ran in this call."""
    ran = False

    def body(*args: Any, **kwargs: Any) -> Any:
        nonlocal ran
        ran = True
        return func(*args, **kwargs)

    started = guard.begin(task_name, slot, policy)
    if version is not None:
        note_version(started, version)
    guard.run(started, body, args, kwargs)
    return ran


def _hand_off(entry: Entry, slot: datetime) -> str:
    with backfilling():  # the call the queue makes is an operator's: no lateness policy
        return hand_off(entry, slot, scheduled=False)


def _enqueue_task(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    result = task.enqueue(*args, **kwargs)
    return f"django.tasks result {result.id} on backend {task.backend!r}"
