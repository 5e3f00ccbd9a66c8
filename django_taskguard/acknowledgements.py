"""Acknowledged problems: an operator says "we know" about a schedule's failed, abandoned or
missed slots, so that they stop failing health; a later problem fails it again.

Each acknowledgement is kept as a ``ScheduleEvent`` (who, from where, when, why, and the
slot it covers up to); the schedule keeps the latest ``acknowledged_until``, which the
health verdict reads.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from . import ledger
from .exceptions import TaskGuardError
from .ledger import schedules as store
from .models import ScheduleEventKind, ScheduleEventOrigin
from .moments import moment_problem
from .schedules import normalize_slot

REASON_REQUIRED = "an acknowledgement needs a reason (who reads it later needs to know why)"


def default_until(task_name: str, now: datetime) -> datetime:
    """What an acknowledgement covers when not told: the slots up to ``now``, but none still
    in flight (pending, running, awaiting a retry): how those come out is not known yet, and
    a failure among them is a new problem."""
    live = ledger.earliest_live_slot(task_name)
    if live is None or live > now:
        return now
    return live - timedelta(microseconds=1)


def acknowledge(
    task_name: str,
    reason: str,
    *,
    until: datetime | None = None,
    by: str = "",
    origin: ScheduleEventOrigin = ScheduleEventOrigin.CODE,
) -> bool:
    """Acknowledge the problems of ``task_name``'s slots at or before ``until`` (default:
    :func:`default_until`); False when the schedule is unknown. ``TaskGuardError`` without
    a reason, or with an ``until`` in the future (it would hide problems that have not
    happened yet)."""
    if not reason or not reason.strip():
        raise TaskGuardError(REASON_REQUIRED)
    if until is not None and (problem := moment_problem(until, "until")) is not None:
        raise TaskGuardError(problem)
    now = timezone.now()
    until = default_until(task_name, now) if until is None else normalize_slot(until)
    if until > now:
        raise TaskGuardError(
            f"until={until.isoformat()} is in the future: only problems that happened can be "
            f"acknowledged"
        )
    if not store.acknowledge(task_name, until):
        return False
    store.record_event(
        task_name,
        ScheduleEventKind.ACKNOWLEDGED,
        origin=origin,
        by=by,
        reason=reason.strip(),
        until=until,
        at=now,
    )
    return True
