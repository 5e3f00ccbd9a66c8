"""Hand a due slot to its task queue once, across every copy of ``run_schedules --enqueue``.

The database decides which copy enqueues: the one whose ``pending`` row for (task, slot)
is new. The others enqueue nothing, so the queue holds one task per slot, not one per
copy (the worker's guard would run the slot once anyway; this saves the queue the
duplicates). The slot travels with the task (``decorators.SLOT_KWARG``) and the worker's
guarded call claims that slot, however late it runs; the claim turns the row
``running``. An enqueue that raises gives the row back (the slot has no row again: the
sweep records it ``missed`` after its grace, or ``backfill`` hands it out again); one
handed out late, which the sweep will not judge again, is recorded ``missed`` instead. A row
that no worker starts within its grace is ended by the missed-slot sweep.

``backfill`` hands out slots the same way (:func:`hand_out`), a Celery beat entry's through
the :class:`SlotSender` that ``contrib.celery`` registers in :data:`SENDERS`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from django.utils import timezone

from . import data_schedules, ledger
from .exceptions import TaskGuardError
from .guard import refused_late
from .logfields import log_fields
from .models import ScheduleSource, TaskSchedule
from .owner import actor
from .registry import Entry
from .signals import run_missed

logger = logging.getLogger("taskguard.scheduler")


class SlotSender(Protocol):
    """A schedule whose slots its task queue's workers run, handed out one by one: a Celery
    beat entry's, for ``backfill``. Used as a context manager around the sends (one broker
    connection for them all)."""

    def __enter__(self) -> SlotSender: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def hand_out(self, slot: datetime, *, missed: bool) -> str:
        """Hand ``slot`` out (its row recorded ``missed``, or none); say what happened."""
        ...


# Makers of a schedule's SlotSender by ``TaskSchedule.source`` (``contrib.celery`` registers
# the beat entries'): given the schedule's row and who backfills (``user@host``); they raise
# ``TaskGuardError`` when the schedule cannot be sent (its entry is gone).
SENDERS: dict[str, Callable[[TaskSchedule, str], SlotSender]] = {}
# The same for data schedules (source ``data``), by ``TaskSchedule.target_kind``
# (``contrib.celery`` registers the Celery tasks').
DATA_SENDERS: dict[str, Callable[[TaskSchedule, str], SlotSender]] = {}


def data_sender(row: TaskSchedule, by: str) -> SlotSender:
    """The SlotSender of the data schedule ``row``, by its target's kind."""
    maker = DATA_SENDERS.get(row.target_kind)
    if maker is None:
        raise TaskGuardError(
            f"{row.task_name} is a data schedule of a {row.target_kind or 'unknown'} target, "
            f"and nothing here can send its slots to a queue"
        )
    return maker(row, by)


SENDERS[ScheduleSource.DATA] = data_sender


def hand_off(entry: Entry, slot: datetime, *, scheduled: bool = True) -> str:
    """Enqueue ``slot`` of ``entry`` unless another copy did; say what happened.

    ``scheduled``: a scheduler's call, so the catch-up policy applies (``catchup="none"``
    records a slot later than its grace ``missed`` instead); backfill's is an operator's.
    """
    if entry.enqueue is None:
        raise TaskGuardError(f"{entry.task_name} is not a task of a task queue: nothing to enqueue")
    ledger.ensure_autocommit()
    if scheduled and refused_late(entry.task_name, slot, entry.policy, timezone.now()):
        return "not enqueued: late (recorded missed, catchup='none')"
    return hand_out(entry.task_name, slot, functools.partial(entry.enqueue, slot))


def hand_out(task_name: str, slot: datetime, enqueue: Callable[[], str]) -> str:
    """Record ``slot`` ``pending`` and call ``enqueue`` (it says what it made), unless the
    slot has a row; an ``enqueue`` that raises gives the row back. Any task queue's
    hand-off: django.tasks' (:func:`hand_off`), a backfilled Celery beat entry's."""
    ledger.ensure_autocommit()
    run_id = ledger.insert_pending(task_name, slot)
    if run_id is None:  # a row that only refused an early call takes the slot from nobody
        run_id = ledger.pend_refused_early(task_name, slot, actor=actor("scheduler"))
    if run_id is None:
        return "not enqueued here (it has a row: another copy enqueued it, or it ran)"
    try:
        made = enqueue()
    except BaseException as exc:
        _give_back(task_name, slot, run_id, exc)
        raise
    return f"enqueued ({made})"


def _give_back(task_name: str, slot: datetime, run_id: int, error: BaseException) -> None:
    reason = f"missed: enqueue failed: {type(error).__name__}: {error}"
    try:
        given = ledger.give_back_pending(
            run_id,
            task_name,
            slot,
            reason=reason,
            actor=actor("scheduler"),
            grace_of=data_schedules.grace_of,
        )
    except Exception as exc:  # whatever it is, the enqueue's own error is the one raised
        logger.warning(
            "taskguard %s slot %s: the enqueue failed and its pending row %s could not be "
            "given back (%s); the sweep records it missed after its grace",
            task_name,
            slot.isoformat(),
            run_id,
            exc,
            extra=log_fields(
                "run.give_back_failed", task=task_name, slot=slot, run_id=run_id, reason=exc
            ),
        )
        return
    if given == "missed":
        logger.warning(
            "taskguard %s slot %s: the enqueue failed, past the slot's grace; recorded missed",
            task_name,
            slot,
            extra=log_fields(
                "run.missed", task=task_name, slot=slot, run_id=run_id, state="missed", reason=error
            ),
        )
        run_missed.send(sender=task_name, slot=slot, reason=reason)
    elif given is not None:
        logger.warning(
            "taskguard %s slot %s: the enqueue failed; the slot was given back",
            task_name,
            slot,
            extra=log_fields(
                "run.given_back", task=task_name, slot=slot, run_id=run_id, reason=error
            ),
        )
