"""Schedule slots: which fire time a call belongs to.

A slot is an aware UTC ``datetime``. Cron expressions are read in Django's
``TIME_ZONE`` (:mod:`.cron`: what a cron means when the clocks change); intervals
are aligned to the Unix epoch so that every instance, whenever it started,
computes the same slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.utils import timezone

from .cron import EPOCH, UTC, CronSchedule, wall_to_utc
from .exceptions import InvalidSchedule

__all__ = [
    "EPOCH",
    "UTC",
    "CronSchedule",
    "IntervalSchedule",
    "Schedule",
    "StoredSchedule",
    "wall_to_utc",
]


@runtime_checkable
class Schedule(Protocol):
    def latest_slot(self, now: datetime) -> datetime:
        """Return the latest fire time at or before ``now`` (aware, UTC)."""

    def slots_between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        """The fire times in ``(start, end]``, oldest first, at most ``limit`` (the oldest)."""

    def count_between(self, start: datetime, end: datetime, cap: int) -> int:
        """How many fire times ``(start, end]`` holds (counting stops at ``cap``)."""


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

    def next_slot(self, now: datetime) -> datetime:
        """The first slot after ``now``."""
        return self.latest_slot(now) + self.every


# What a ``TaskSchedule`` row stores and :func:`rebuild` gives back.
StoredSchedule = CronSchedule | IntervalSchedule


# Functions that turn another library's schedule object into ours, or return None when
# it is not theirs; ``build`` asks them in order (``contrib.celery`` registers one for
# celery's ``crontab`` and ``schedule``).
TRANSLATORS: list[Callable[[Any], Schedule | None]] = []


def build(
    cron: str | None, every: timedelta | None, schedule: Any, time_zone: str | None = None
) -> Schedule | None:
    """Check the decorator's schedule arguments and return one schedule (or None).
    ``time_zone``: the IANA zone a cron (``cron=``, or ``schedule=`` a cron string) is read
    in instead of Django's ``TIME_ZONE``; refused with any other schedule."""
    given = [
        name
        for name, value in (("cron", cron), ("every", every), ("schedule", schedule))
        if value is not None
    ]
    if len(given) > 1:
        raise InvalidSchedule(
            f"give at most one of cron=, every=, schedule= (got {', '.join(given)})"
        )
    if time_zone is not None:
        return _zoned(cron if cron is not None else schedule, every, time_zone)
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
    for translate in TRANSLATORS:
        translated = translate(schedule)
        if translated is not None:
            return translated
    raise InvalidSchedule(
        f"unsupported schedule object: {schedule!r} (schedule= takes a cron string, a "
        f"timedelta, a taskguard schedule, or a celery crontab/schedule with "
        f"django-taskguard[celery] installed)"
    )


def _zoned(cron: Any, every: timedelta | None, time_zone: str) -> CronSchedule:
    if not isinstance(cron, str) or every is not None:
        raise InvalidSchedule(
            f"time_zone={time_zone!r} goes with a cron schedule only (cron=...): an "
            f"interval's slots are aligned to the epoch (UTC), and a celery crontab "
            f"carries its own zone"
        )
    try:
        ZoneInfo(time_zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule(
            f"unknown time zone {time_zone!r}: give an IANA name such as Europe/Berlin"
        ) from None
    return CronSchedule(cron, time_zone)


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


# Distinct stored schedules kept built: health, metrics, the overview and the sweep rebuild
# every row on every call, and building a cron (parsing, and a first walk to refuse one that
# never fires) cost most of a health check with thousands of schedules. Schedules are
# frozen values, so one built copy serves every caller and thread.
REBUILT_CACHE_SIZE = 8192


@lru_cache(maxsize=REBUILT_CACHE_SIZE)
def rebuild(cron: str, day_or: bool, time_zone: str, every: timedelta | None) -> StoredSchedule:
    """The schedule a ``TaskSchedule`` row stores (built once per distinct value)."""
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
