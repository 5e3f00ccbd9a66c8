"""Schedule slots: which fire time a call belongs to.

A slot is an aware UTC ``datetime``. Cron expressions are read in Django's
``TIME_ZONE``; intervals are aligned to the Unix epoch so that every instance,
whenever it started, computes the same slots.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, Protocol, runtime_checkable
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, CroniterError, croniter
from django.utils import timezone

from .exceptions import InvalidSchedule

UTC = dt_timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# No time zone moves its clocks by this much at once (most move by one hour).
DST_WINDOW = timedelta(hours=3)


@runtime_checkable
class Schedule(Protocol):
    def latest_slot(self, now: datetime) -> datetime:
        """Return the latest fire time at or before ``now`` (aware, UTC)."""

    def slots_between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        """The fire times in ``(start, end]``, oldest first, at most ``limit`` (the oldest)."""

    def count_between(self, start: datetime, end: datetime, cap: int) -> int:
        """How many fire times ``(start, end]`` holds (counting stops at ``cap``)."""


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
        if len(fields) != 5:
            raise InvalidSchedule(
                f"cron expression {self.expression!r} has {len(fields)} fields; it needs 5 "
                f"(minute hour day-of-month month day-of-week)"
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

    def _zone(self) -> Any:
        return ZoneInfo(self.tz_name) if self.tz_name else timezone.get_default_timezone()

    def latest_slot(self, now: datetime) -> datetime:
        zone = self._zone()
        # Cron matches wall-clock times, so walk it on naive local time; the
        # first second after ``now`` makes ``get_prev`` include ``now`` itself.
        wall = now.astimezone(zone).replace(tzinfo=None, microsecond=0) + timedelta(seconds=1)
        latest = croniter(self.expression, wall, day_or=self.day_or).get_prev(datetime)
        if not _offset_changes(zone, wall - DST_WINDOW, wall + DST_WINDOW):
            return wall_to_utc(latest, zone)
        # Near a DST change wall time is not monotonic in real time (an hour
        # repeats or is skipped), so a fire time later on the wall clock may
        # already be past (the repeated hour) and an earlier one still ahead
        # (the skipped hour, shifted forward). Look at every fire time within
        # the window either side and keep the latest one that is not in the
        # future; the window's far edge always qualifies.
        candidates = [latest]
        back = croniter(self.expression, latest, day_or=self.day_or)
        while candidates[-1] >= wall - DST_WINDOW:
            candidates.append(back.get_prev(datetime))
        ahead = croniter(self.expression, wall, day_or=self.day_or)
        while (fire := ahead.get_next(datetime)) <= wall + DST_WINDOW:
            candidates.append(fire)
        return max(utc for utc in (wall_to_utc(fire, zone) for fire in candidates) if utc <= now)

    def slots_between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        return list(_take(self._walk(start, end), limit))

    def count_between(self, start: datetime, end: datetime, cap: int) -> int:
        return sum(1 for _ in _take(self._walk(start, end), cap))

    def _walk(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Fire times in ``(start, end]`` in order: wall times from a DST window before
        ``start`` on, mapped to UTC, kept when inside (a repeated or skipped hour maps
        some of them out of order, hence the window and the check against the last)."""
        zone = self._zone()
        wall = start.astimezone(zone).replace(tzinfo=None) - DST_WINDOW
        end_wall = end.astimezone(zone).replace(tzinfo=None) + DST_WINDOW
        walker = croniter(self.expression, wall, day_or=self.day_or)
        last = start
        while (fire := walker.get_next(datetime)) <= end_wall:
            utc = wall_to_utc(fire, zone)
            if last < utc <= end:
                last = utc
                yield utc


def _take(items: Iterator[datetime], limit: int) -> Iterator[datetime]:
    for count, item in enumerate(items):
        if count >= limit:
            return
        yield item


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


def _offset_changes(zone: Any, start: datetime, end: datetime) -> bool:
    """True when ``zone``'s UTC offset is not the same at both naive wall times."""
    return bool(start.replace(tzinfo=zone).utcoffset() != end.replace(tzinfo=zone).utcoffset())


@dataclass(frozen=True)
class IntervalSchedule:
    """Every ``every``, on multiples of it counted from the Unix epoch (UTC)."""

    every: timedelta

    def __post_init__(self) -> None:
        if not isinstance(self.every, timedelta):
            raise InvalidSchedule(f"every= must be a timedelta, not {type(self.every).__name__}")
        if self.every < timedelta(seconds=1):
            raise InvalidSchedule(f"every= must be at least one second, got {self.every!r}")

    def latest_slot(self, now: datetime) -> datetime:
        step = self.every // timedelta(microseconds=1)
        since = (now - EPOCH) // timedelta(microseconds=1)
        return EPOCH + timedelta(microseconds=since - since % step)

    def slots_between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        first = self.latest_slot(start) + self.every
        count = min(limit, self.count_between(start, end, limit))
        return [first + self.every * n for n in range(count)]

    def count_between(self, start: datetime, end: datetime, cap: int) -> int:
        if end <= start:
            return 0
        return min(cap, (end - self.latest_slot(start)) // self.every)


def wall_to_utc(wall: datetime, zone: Any) -> datetime:
    """Map a naive wall-clock time in ``zone`` to UTC, the same way on every instance.

    An ambiguous time (the hour repeated when clocks fall back) is its first
    occurrence, so a cron slot at 01:30 on a fall-back night is one slot, not
    two. A time that does not exist (the hour skipped when clocks spring
    forward) is shifted forward by the gap, as cron does.
    """
    return wall.replace(tzinfo=zone, fold=0).astimezone(UTC)


def from_celery(schedule: Any) -> Schedule:
    """Translate a celery ``crontab`` or ``schedule`` into ours."""
    try:
        from celery.schedules import crontab
        from celery.schedules import schedule as celery_schedule
    except ImportError:  # pragma: no cover - celery is an extra
        raise InvalidSchedule(
            f"schedule={schedule!r} is not supported (install django-taskguard[celery] "
            f"for celery crontab/schedule objects)"
        ) from None
    if isinstance(schedule, crontab):
        return CronSchedule(celery_cron_expression(schedule), day_or=False)
    if isinstance(schedule, celery_schedule):
        return IntervalSchedule(getattr(schedule, "run_every"))  # noqa: B009 (untyped in stubs)
    raise InvalidSchedule(f"unsupported schedule object: {schedule!r}")


def celery_cron_expression(schedule: Any) -> str:
    """A five-field cron expression for a celery ``crontab``, from its parsed fields.

    The parsed sets are used (not the original arguments, which may be sets,
    ranges or names); a field that allows every value is written ``*``.
    Celery requires the day of month and the day of week to match both: pair
    the expression with ``day_or=False``.
    """
    fields = (
        (schedule.minute, 60),
        (schedule.hour, 24),
        (schedule.day_of_month, 31),
        (schedule.month_of_year, 12),
        (schedule.day_of_week, 7),
    )
    return " ".join(
        "*" if len(values) >= size else ",".join(str(v) for v in sorted(values))
        for values, size in fields
    )


def build(cron: str | None, every: timedelta | None, schedule: Any) -> Schedule | None:
    """Check the decorator's schedule arguments and return one schedule (or None)."""
    given = [
        name
        for name, value in (("cron", cron), ("every", every), ("schedule", schedule))
        if value is not None
    ]
    if len(given) > 1:
        raise InvalidSchedule(
            f"give at most one of cron=, every=, schedule= (got {', '.join(given)})"
        )
    if cron is not None:
        return CronSchedule(cron)
    if every is not None:
        return IntervalSchedule(every)
    if schedule is None:
        return None
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        return CronSchedule(schedule)
    if isinstance(schedule, timedelta):
        return IntervalSchedule(schedule)
    return from_celery(schedule)


def describe(schedule: Schedule) -> dict[str, Any]:
    """The stored form of a schedule (``TaskSchedule``'s fields); :func:`rebuild` reads it."""
    if isinstance(schedule, CronSchedule):
        return {
            "cron": schedule.expression,
            "cron_day_or": schedule.day_or,
            "time_zone": schedule.tz_name or "",
            "every": None,
        }
    if isinstance(schedule, IntervalSchedule):
        return {"cron": "", "cron_day_or": True, "time_zone": "", "every": schedule.every}
    raise InvalidSchedule(f"{schedule!r} cannot be stored (a cron or interval schedule can)")


def rebuild(cron: str, day_or: bool, time_zone: str, every: timedelta | None) -> Schedule:
    """The schedule a ``TaskSchedule`` row stores."""
    if cron:
        return CronSchedule(cron, time_zone or None, day_or)
    if every is None:
        raise InvalidSchedule("a stored schedule has neither a cron expression nor an interval")
    return IntervalSchedule(every)


def normalize_slot(slot: Any) -> datetime:
    """Validate an explicit (or stamped) slot and return it as an aware UTC datetime."""
    if type(slot) is datetime and slot.tzinfo is UTC:
        return slot  # the common case, without conversions
    if isinstance(slot, str):
        try:
            slot = datetime.fromisoformat(slot.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidSchedule(f"slot is not an ISO-8601 datetime: {slot!r}") from None
    if not isinstance(slot, datetime):
        raise InvalidSchedule(f"slot must be an aware datetime, not {type(slot).__name__}")
    if timezone.is_naive(slot):
        raise InvalidSchedule(
            f"slot must be timezone-aware (got naive {slot.isoformat()}): make it aware with "
            f"django.utils.timezone.make_aware(slot) (in TIME_ZONE) or "
            f"slot.replace(tzinfo=datetime.timezone.utc)"
        )
    utc: datetime = slot.astimezone(UTC)
    return utc
