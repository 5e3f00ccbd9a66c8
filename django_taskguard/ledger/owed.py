"""Owed windows: the slots of a data schedule's definition that a change ended (an edit of
its slots, a disable, a deletion) before the missed-slot sweep had judged them.

The sweep judges a schedule's slots by its current definition, from its mark
(``swept_until``). A change that moves the slots, or stops them, would leave the old
definition's slots after that mark unjudged: a slot due just before the change that no
copy fired would be neither run nor recorded. So the change keeps that window on the row
(``TaskSchedule.owed``: the old definition, from the mark to the change by the database's
clock, the instant the schedulers take as the change too), and the sweep judges it once
its grace has passed (``owed_due_at``, indexed), by the definition it belonged to
(:func:`django_taskguard.missed.sweep_missed`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import reduce
from operator import or_
from typing import Any

from django.db.models import Q

from ..logfields import log_fields
from ..models import TaskSchedule
from ..schedules import rebuild
from .core import alias, translated

logger = logging.getLogger("taskguard.ledger")

_TICK = timedelta(microseconds=1)
# Windows kept per schedule (many changes within one grace): beyond, the oldest is dropped
# (said in the log).
OWED_LIMIT = 50


@dataclass(frozen=True)
class Owed:
    """A window of slots an earlier definition of a data schedule owes the sweep: ``(since,
    until]`` of that definition (its cron or interval, zone, ``starts``/``ends``, grace)."""

    cron: str
    day_or: bool
    zone: str
    every: timedelta | None
    starts: datetime | None
    ends: datetime | None
    grace: timedelta
    since: datetime
    until: datetime
    version: int

    @property
    def due_at(self) -> datetime:
        return self.until + self.grace

    def slots(self, floor: datetime | None = None, limit: int = 1) -> list[datetime]:
        """Its slots (within its ``starts``/``ends``, none at or before ``floor``), at
        most ``limit``."""
        since = self.since if floor is None else max(self.since, floor)
        if self.starts is not None:
            since = max(since, self.starts - _TICK)
        until = self.until if self.ends is None else min(self.until, self.ends)
        if until <= since:
            return []
        schedule = rebuild(self.cron, self.day_or, self.zone, self.every)
        return schedule.slots_between(since, until, limit)

    def as_json(self) -> dict[str, Any]:
        return {
            "cron": self.cron,
            "day_or": self.day_or,
            "zone": self.zone,
            "every": None if self.every is None else self.every.total_seconds(),
            "starts": _iso(self.starts),
            "ends": _iso(self.ends),
            "grace": self.grace.total_seconds(),
            "since": _iso(self.since),
            "until": _iso(self.until),
            "version": self.version,
        }

    @classmethod
    def of(cls, value: dict[str, Any]) -> Owed:
        """Read a window back (raises on anything but what :meth:`as_json` wrote)."""
        since, until = _moment(value["since"]), _moment(value["until"])
        if since is None or until is None:
            raise ValueError(f"an owed window without since or until: {value!r}")
        return cls(
            cron=str(value["cron"]),
            day_or=bool(value["day_or"]),
            zone=str(value["zone"]),
            every=None if value["every"] is None else timedelta(seconds=value["every"]),
            starts=_moment(value["starts"]),
            ends=_moment(value["ends"]),
            grace=timedelta(seconds=value["grace"]),
            since=since,
            until=until,
            version=int(value["version"]),
        )


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _moment(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def owe(row: TaskSchedule, zone: str, grace: timedelta, until: datetime) -> None:
    """``row``'s definition (as read, before the change being saved; its cron's ``zone``;
    the ``grace`` it followed) ends at ``until`` (the change's time by the database's
    clock): its slots after the sweep's mark become an owed window. Nothing when it was
    not judged (disabled, deleted) or the window holds no slot (a daily report edited
    between two sweeps). The caller saves the row."""
    if row.removed_at is not None or not row.enabled:
        return
    window = Owed(
        cron=row.cron,
        day_or=row.cron_day_or,
        zone=zone,
        every=row.every,
        starts=row.starts,
        ends=row.ends,
        grace=grace,
        since=row.swept_until or row.first_seen,
        until=until,
        version=row.version,
    )
    try:
        if not window.slots():
            return
    except Exception:  # a zone this process's tzdata lacks: kept, the sweep says so
        pass
    windows = [*row.owed, window.as_json()]
    if len(windows) > OWED_LIMIT:
        dropped = windows.pop(0)
        logger.warning(
            "taskguard %s: more than %d changes within a grace: the slots of version %s up to "
            "%s are not judged by the sweep",
            row.task_name,
            OWED_LIMIT,
            dropped["version"],
            dropped["until"],
            extra=log_fields("sweep.owed_dropped", task=row.task_name),
        )
    row.owed = windows
    row.owed_due_at = min(Owed.of(value).due_at for value in windows)


def owed_due(now: datetime, task: str | None = None) -> list[int]:
    """The ids of the schedules with an owed window whose grace has passed by ``now`` (a
    range scan of ``owed_due_at``'s index), in order."""
    rows = TaskSchedule.objects.using(alias()).filter(owed_due_at__lte=now)
    if task is not None:
        rows = rows.filter(task_name=task)
    with translated:
        return list(rows.order_by("id").values_list("id", flat=True))


def owed_page(ids: Sequence[int]) -> list[TaskSchedule]:
    """The schedules of ``ids`` with what the sweep reads of them, by id."""
    rows = TaskSchedule.objects.using(alias()).filter(id__in=list(ids))
    with translated:
        return list(rows.defer("args", "kwargs", "description").order_by("id"))


def settle(settled: Sequence[tuple[TaskSchedule, Sequence[Owed]]]) -> int:
    """For each ``(row, left)``: keep only ``left`` of ``row``'s owed windows, if the row is
    still at the version the sweep read (a change since may have added one: the next sweep
    judges again, and finds the slots it wrote recorded). One statement for the rows left
    with none. Returns how many rows were settled."""
    done = 0
    empty = [row for row, left in settled if not left]
    rows = TaskSchedule.objects.using(alias())
    with translated:
        for start in range(0, len(empty), 400):
            part = empty[start : start + 400]
            read = reduce(or_, (Q(id=row.id, version=row.version) for row in part))
            done += rows.filter(read).update(owed=[], owed_due_at=None)
        for row, left in settled:
            if left:
                due = min(owed.due_at for owed in left)
                done += rows.filter(id=row.id, version=row.version).update(
                    owed=[owed.as_json() for owed in left], owed_due_at=due
                )
    return done
