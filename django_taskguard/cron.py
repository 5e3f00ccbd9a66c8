"""Cron slots: a five-field cron expression read in a time zone's wall-clock time.

What a cron means when the clocks change (docs/schedules.md, "Daylight saving time"):

- A wall time that happens twice (the hour repeated when clocks fall back) is two
  slots, one per pass, when the cron's hour field allows every hour (``* * * * *``,
  ``*/5 * * * *``, ``0 * * * *``): such a cron means "every so often", and the
  repeated hour is an hour of real time like any other. A cron that names its hours
  (``30 2 * * *``, ``* 2 * * *``, ``0 */2 * * *``) means a time of day: it fires once,
  on the first pass.
- A wall time that does not happen (the hour skipped when clocks spring forward) is
  shifted forward by the gap: ``30 2 * * *`` fires at 03:30 that day.

Each schedule's fire times come from one walk that steps forward from the last one
it gave out (:class:`_Walk`, kept per expression, zone and day rule); a question that
starts before the kept times starts a new walk there (:func:`plain_latest`, then
:func:`fire_times`), which gives the same answers.
"""

from __future__ import annotations

import bisect
import heapq
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import cached_property
from itertools import islice, takewhile
from typing import Any
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, CroniterError, croniter
from django.utils import timezone
from django.utils.translation import ngettext

from .exceptions import InvalidSchedule

UTC = dt_timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# No time zone moves its clocks by this much at once (most move by one hour).
DST_WINDOW = timedelta(hours=3)
# Fire times a walk keeps behind the newest one (the sweep's and health's questions look
# a few slots back), and the walks kept (one per expression, zone and day rule, the least
# recently asked dropped): at most 4096 walks of 128 datetimes each between trims, about
# 40 MB held (measured with tracemalloc: 39.1 MB, 9.5 kB a walk; bench/bench_cron_memory.py).
KEEP_TIMES = 64
KEEP_WALKS = 4096
# Cron's aliases (not supported: an error says which five fields to write instead).
ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# How far ahead a cron's ``next_slot`` looks (beyond it: None).
NEXT_SLOT_HORIZON = timedelta(days=800)


@dataclass(frozen=True)
class CronSchedule:
    """A five-field cron expression evaluated in a time zone's wall-clock time."""

    expression: str
    tz_name: str | None = None  # None: Django's TIME_ZONE at evaluation time
    # True: cron's rule (a day matches if day-of-month OR day-of-week does, when both
    # are restricted); False: both must match, as in celery's crontab.
    day_or: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.expression, str):
            raise InvalidSchedule(f"cron= must be a string, not {type(self.expression).__name__}")
        fields = self.expression.split()
        if fields and fields[0].startswith("@"):
            instead = ALIASES.get(fields[0].lower())
            raise InvalidSchedule(
                f"cron aliases such as {fields[0]} are not supported"
                + (f"; write {instead}" if instead else ": write five fields")
                + f" (cron expression {self.expression!r})"
            )
        if len(fields) != 5:
            raise InvalidSchedule(
                ngettext(
                    "cron expression %(expression)r has %(n)d field; it needs 5 "
                    "(minute hour day-of-month month day-of-week)",
                    "cron expression %(expression)r has %(n)d fields; it needs 5 "
                    "(minute hour day-of-month month day-of-week)",
                    len(fields),
                )
                % {"expression": self.expression, "n": len(fields)}
            )
        try:
            croniter(self.expression)
        except (CroniterError, ValueError) as exc:
            raise InvalidSchedule(
                f"invalid cron expression {self.expression!r}: {_bad_field(fields)} ({exc})"
            ) from exc
        try:
            croniter(self.expression, EPOCH.replace(tzinfo=None), day_or=self.day_or).get_next(
                datetime
            )
        except (CroniterBadDateError, ValueError):
            raise InvalidSchedule(f"cron expression never fires: {self.expression!r}") from None

    @cached_property
    def every_hour(self) -> bool:
        """True when the hour field allows every hour: both passes of a repeated hour fire."""
        hours = croniter(self.expression).expanded[1]
        return hours == ["*"] or len(set(hours)) == 24

    def zone(self) -> Any:
        return ZoneInfo(self.tz_name) if self.tz_name else timezone.get_default_timezone()

    def instants(self, wall: datetime, zone: Any) -> tuple[datetime, ...]:
        """The UTC instants of one naive wall fire time (two for a repeated one, when the
        cron fires every hour; a skipped one shifted forward by the gap)."""
        first = wall_to_utc(wall, zone)
        if not self.every_hour:
            return (first,)
        second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
        return (first, second) if second > first else (first,)

    def latest_slot(self, now: datetime) -> datetime:
        return _walk(self, now).latest(now)

    def slots_between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        return _walk(self, start).between(start, end, limit)

    def count_between(self, start: datetime, end: datetime, cap: int) -> int:
        return len(_walk(self, start).between(start, end, cap))

    def next_slot(self, now: datetime) -> datetime | None:
        """The first slot after ``now`` (None when none comes within 800 days)."""
        found = self.slots_between(now, now + NEXT_SLOT_HORIZON, 1)
        return found[0] if found else None


def fire_times(cron: CronSchedule, zone: Any, after: datetime) -> Iterator[datetime]:
    """Every fire time after ``after``, in order, without end.

    Wall fire times are walked in order and mapped to their instants. Near a DST change
    that order is not the instants' (a repeated or skipped hour), so there the walk
    starts a window before ``after`` and holds each instant back until no later wall
    time can map before it (none maps more than the window before its predecessor).
    """
    local = after.astimezone(zone).replace(tzinfo=None)
    near = _offset_changes(zone, local - DST_WINDOW, local + DST_WINDOW)
    walker = croniter(cron.expression, local - DST_WINDOW if near else local, day_or=cron.day_or)
    waiting: list[datetime] = []
    last = horizon = after - DST_WINDOW
    while True:
        fire = walker.get_next(datetime)
        found = cron.instants(fire, zone)
        for instant in found:
            if instant > after:
                heapq.heappush(waiting, instant)
        if _offset_changes(zone, fire - DST_WINDOW, fire + DST_WINDOW):
            horizon = max(horizon, found[0] - DST_WINDOW)
        else:
            horizon = max(horizon, found[0])
        while waiting and waiting[0] < horizon:
            instant = heapq.heappop(waiting)
            if instant > last:
                last = instant
                yield instant


def plain_latest(cron: CronSchedule, zone: Any, now: datetime) -> datetime:
    """The latest fire time at or before ``now``, from croniter's step back."""
    # Cron matches wall-clock times, so step on naive local time; the first second
    # after ``now`` makes ``get_prev`` include ``now`` itself.
    wall = now.astimezone(zone).replace(tzinfo=None, microsecond=0) + timedelta(seconds=1)
    latest = croniter(cron.expression, wall, day_or=cron.day_or).get_prev(datetime)
    if not _offset_changes(zone, wall - DST_WINDOW, wall + DST_WINDOW):
        return max(utc for utc in cron.instants(latest, zone) if utc <= now)
    # Near a DST change wall time is not monotonic in real time: look at every fire time
    # within the window either side; the window's far edge always qualifies.
    fires = [latest]
    back = croniter(cron.expression, latest, day_or=cron.day_or)
    while fires[-1] >= wall - DST_WINDOW:
        fires.append(back.get_prev(datetime))
    ahead = croniter(cron.expression, wall, day_or=cron.day_or)
    while (fire := ahead.get_next(datetime)) <= wall + DST_WINDOW:
        fires.append(fire)
    return max(utc for fire in fires for utc in cron.instants(fire, zone) if utc <= now)


def plain_between(cron: CronSchedule, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """``slots_between`` from a fresh walk (what the kept walks must agree with)."""
    stream = fire_times(cron, cron.zone(), start)
    return list(islice(takewhile(lambda time: time <= end, stream), limit))


class _Walk:
    """One cron's fire times as they are stepped through: every one in
    ``(after, times[-1]]`` is in ``times``."""

    def __init__(self, cron: CronSchedule, zone: Any, start: datetime) -> None:
        self.cron, self.zone = cron, zone
        self.lock = threading.Lock()
        self._restart(start)

    def _restart(self, start: datetime) -> None:
        self.after = plain_latest(self.cron, self.zone, start) - timedelta(microseconds=1)
        self.times: list[datetime] = []
        self._stream = fire_times(self.cron, self.zone, self.after)

    def latest(self, now: datetime) -> datetime:
        with self.lock:
            self._hold(now)
            self._catch_up(now)
            self._step(lambda: self.times[-1] <= now)
            found = bisect.bisect_right(self.times, now)
            latest = self.times[found - 1] if found else None
            self._trim()
        # None: the latest is at or before where this walk began.
        return latest if latest is not None else plain_latest(self.cron, self.zone, now)

    def between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        with self.lock:
            self._hold(start)
            self._catch_up(start)
            first = bisect.bisect_right(self.times, start)
            self._step(lambda: len(self.times) - first < limit and self.times[-1] <= end)
            found = self.times[first : first + limit]
            self._trim()
        return [time for time in found if time <= end]

    def _hold(self, start: datetime) -> None:
        """Start again from ``start`` when the walk begins at or after it: :func:`_walk`
        saw it begin before, but another question (another thread) may have started it
        again or trimmed it since, and the times in between are not all kept."""
        if self.after >= start:
            self._restart(start)

    def _catch_up(self, start: datetime) -> None:
        """Step forward to ``start``; start again from it when that is far."""
        for _ in range(KEEP_TIMES):
            if self.times and self.times[-1] >= start:
                return
            self.times.append(next(self._stream))
        self._restart(start)
        while not self.times or self.times[-1] < start:  # two steps at most
            self.times.append(next(self._stream))

    def _step(self, more: Callable[[], bool]) -> None:
        if not self.times:
            self.times.append(next(self._stream))
        while more():
            self.times.append(next(self._stream))

    def _trim(self) -> None:
        if len(self.times) > 2 * KEEP_TIMES:
            self.after = self.times[-KEEP_TIMES - 1]
            del self.times[:-KEEP_TIMES]


_walks: OrderedDict[tuple[str, str, bool], _Walk] = OrderedDict()
_walks_lock = threading.Lock()


def _after_fork() -> None:
    """A forked child starts with no kept walks and a free lock: one held at the fork by
    another thread of its parent (an upkeep's sweep beside a prefork pool that forks a new
    child) would be held in the child for good."""
    global _walks_lock
    _walks_lock = threading.Lock()
    _walks.clear()


os.register_at_fork(after_in_child=_after_fork)


def _walk(cron: CronSchedule, start: datetime) -> _Walk:
    """The kept walk of ``cron`` when it holds ``start`` or can step to it, else a new one
    from ``start``, kept in its place (a question behind the kept times, a clock stepped
    back: the next question steps forward from there, or starts again)."""
    zone = cron.zone()
    key = (cron.expression, str(zone), cron.day_or)
    with _walks_lock:
        kept = _walks.get(key)
        if kept is not None:
            _walks.move_to_end(key)
            if kept.after < start:
                return kept
        walk = _walks[key] = _Walk(cron, zone, start)
        while len(_walks) > KEEP_WALKS:
            _walks.popitem(last=False)
        return walk


def wall_to_utc(wall: datetime, zone: Any) -> datetime:
    """Map a naive wall-clock time in ``zone`` to UTC, the same way on every instance.

    An ambiguous time (the hour repeated when clocks fall back) is its first
    occurrence (:meth:`CronSchedule.instants` adds the second for a cron that fires
    every hour). A time that does not exist (the hour skipped when clocks spring
    forward) is shifted forward by the gap, as celery's crontab does (ISC cron and
    croniter fire it at the change instead).
    """
    return wall.replace(tzinfo=zone, fold=0).astimezone(UTC)


def _offset_changes(zone: Any, start: datetime, end: datetime) -> bool:
    """True when ``zone``'s UTC offset is not the same at both naive wall times."""
    return bool(start.replace(tzinfo=zone).utcoffset() != end.replace(tzinfo=zone).utcoffset())


CRON_FIELDS = (
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day-of-month", "1-31"),
    ("month", "1-12 or jan-dec"),
    ("day-of-week", "0-7 or sun-sat"),
)


def _bad_field(fields: list[str]) -> str:
    """Name the first field that is wrong on its own (the others made ``*``)."""
    for index, (name, allowed) in enumerate(CRON_FIELDS):
        alone = ["*"] * 5
        alone[index] = fields[index]
        if not croniter.is_valid(" ".join(alone)):
            return f"the {name} field {fields[index]!r} is not valid (allowed: {allowed})"
    return "its fields do not work together"
