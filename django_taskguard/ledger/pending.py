"""Slots handed to a task queue (``run_schedules --enqueue``, ``backfill --enqueue``).

A ``pending`` row says that one copy enqueued the slot: the other copies find the row
and enqueue nothing, and the worker's claim turns it ``running``. A hand-off that failed
gives its row back; one that no worker starts within its grace is ended by the
missed-slot sweep (``missed``, or ``skipped`` while the task is paused).
"""

from __future__ import annotations

from datetime import datetime

from django.db import DatabaseError

from ..states import RunState
from . import sql
from .core import (
    ERROR_MAX_LENGTH,
    Row,
    Step,
    change,
    clip,
    dialect,
    one,
    runs,
    slot_param,
    unreachable,
)


def insert_pending(task_name: str, slot: datetime) -> int | None:
    """Record ``slot`` as handed out (``pending``); None when it has a row already."""
    try:
        found = one(
            sql.insert_pending(dialect()), [task_name, slot_param(slot), RunState.PENDING.value]
        )
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return int(found[0]) if found else None


def give_back_pending(run_id: int) -> bool:
    """Delete a ``pending`` row that no attempt started (its enqueue failed), so that the
    slot has no row again; False when something started it meanwhile."""
    try:
        return one(sql.give_back_pending(dialect()), [run_id, RunState.PENDING.value]) is not None
    except DatabaseError as exc:
        raise unreachable(exc) from exc


def end_pending(
    task_name: str,
    after: datetime,
    until: datetime,
    *,
    state: str,
    reason: str,
    actor: str,
    limit: int,
) -> list[datetime]:
    """The ``pending`` slots of ``task_name`` in ``(after, until]`` (at most ``limit``,
    oldest first) become ``state`` (``missed``, or ``skipped``); returns those changed."""
    try:
        found = list(
            runs()
            .filter(
                task_name=task_name,
                key__isnull=True,
                state=RunState.PENDING,
                slot__gt=after,
                slot__lte=until,
            )
            .order_by("slot")
            .values_list("id", "slot", "attempt", "fence", "owner", "lease_until")[:limit]
        )
        ended = []
        stored = clip(reason, ERROR_MAX_LENGTH)
        for run_id, slot, attempt, fence, owner, lease_until in found:
            row = Row(run_id, RunState.PENDING, attempt, fence, owner, lease_until)
            changed = change(
                row,
                [Step(state, reason)],
                actor=actor,
                fenced=False,
                sets=sql.END_ATTEMPT,
                values=(stored, 0),
            )
            if changed is not None:
                ended.append(slot)
    except DatabaseError as exc:
        raise unreachable(exc) from exc
    return ended
