"""What taskguard's beat schedulers and worker glue agree on: headers, identities, slots.

Beat stamps two headers on every message: ``taskguard_slot`` (ISO-8601 UTC, the
fire time the entry was due for) and ``taskguard_schedule`` (the entry's
name); the worker reads them back. A data schedule's messages also carry
``taskguard_version``. A put-back message carries
``taskguard_deferred``, and a message ``manage.py backfill`` sent ``taskguard_backfill``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from django.utils import timezone

from ... import schedules
from ...decorating import task_identity
from ...exceptions import TaskGuardError

__all__ = ["task_identity"]  # re-exported: the worker, the beat and backfill name runs with it

UTC = dt_timezone.utc
SLOT_HEADER = "taskguard_slot"
SCHEDULE_HEADER = "taskguard_schedule"
PERIODIC_TASK_HEADER = "periodic_task_name"  # django-celery-beat's own header
DEFERRED_HEADER = "taskguard_deferred"  # how often a redelivery was put back
# A beat entry's misfire grace, in seconds, set by the user in the entry's
# ``options={"headers": {"taskguard_grace": 60}}``: a message later than that is recorded missed.
GRACE_HEADER = "taskguard_grace"
# apply_once: {"key": ..., "ttl": seconds, "keep": seconds or None} of the message
ENQUEUE_HEADER = "taskguard_enqueue"
# ``manage.py backfill``'s messages: who sent them (``user@host``). The worker applies no
# lateness policy to them, as to any operator's call.
BACKFILL_HEADER = "taskguard_backfill"
# A data schedule's messages: the version of the schedule that sent them (the run records it).
VERSION_HEADER = "taskguard_version"
HEADERS = (
    SLOT_HEADER,
    SCHEDULE_HEADER,
    PERIODIC_TASK_HEADER,
    DEFERRED_HEADER,
    GRACE_HEADER,
    ENQUEUE_HEADER,
    BACKFILL_HEADER,
    VERSION_HEADER,
)


def grace_of(headers: dict[str, Any]) -> timedelta | None:
    """The ``taskguard_grace`` header as a timedelta (None: absent or not a positive number)."""
    value = headers.get(GRACE_HEADER)
    try:
        seconds = float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        seconds = None
    if seconds is None or not 0 < seconds <= 7 * 86_400:
        return None
    return timedelta(seconds=seconds)


def message_headers(request: Any) -> dict[str, Any]:
    """The taskguard headers of a request: in ``request.headers`` (eager, retries) or
    as request attributes (a worker merges message headers into the request)."""
    headers = dict(getattr(request, "headers", None) or {})
    for name in HEADERS:
        value = getattr(request, name, None)
        if value is not None:
            headers.setdefault(name, value)
    return headers


def slot_for(schedule: Any, now: datetime) -> datetime | None:
    """The slot a beat entry with ``schedule`` is due for at ``now`` (aware), or None.

    crontab: its latest fire time at or before ``now`` in the crontab's time
    zone (celery's ``timezone`` setting unless the crontab has its own), with
    celery's field semantics and :mod:`django_taskguard.schedules`' DST rule.
    Interval: the latest epoch-aligned multiple of ``run_every``. Clocked
    (django-celery-beat): the clocked time. An object with ``latest_slot(now)``
    (a taskguard schedule): what it says. Anything else (solar): None.
    """
    now = now.astimezone(UTC)
    clocked_time = getattr(schedule, "clocked_time", None)
    if isinstance(clocked_time, datetime):
        return clocked_time.astimezone(UTC) if timezone.is_aware(clocked_time) else None
    if isinstance(schedule, crontab):
        return cron_of(schedule).latest_slot(now)
    if isinstance(schedule, interval_schedule):
        every: timedelta = getattr(schedule, "run_every")  # noqa: B009 (untyped in stubs)
        if every < timedelta(seconds=1):
            return None
        return schedules.IntervalSchedule(every).latest_slot(now)
    if isinstance(schedule, schedules.Schedule):
        return schedule.latest_slot(now)
    return None


def cron_of(schedule: crontab) -> schedules.CronSchedule:
    """A celery crontab as taskguard's cron: its fields, its zone, both day fields must match."""
    expression = cron_expression(schedule)
    return schedules.CronSchedule(expression, tz_name=zone_name(schedule.tz), day_or=False)


def from_celery(schedule: Any) -> schedules.Schedule | None:
    """A celery ``crontab`` or ``schedule`` given to ``schedule=``, as ours (None: neither).

    The crontab is read in Django's ``TIME_ZONE`` like a ``cron=`` string (the beat's
    :func:`cron_of` uses the crontab's own zone instead)."""
    if isinstance(schedule, crontab):
        return schedules.CronSchedule(cron_expression(schedule), day_or=False)
    if isinstance(schedule, interval_schedule):
        every: timedelta = getattr(schedule, "run_every")  # noqa: B009 (untyped in stubs)
        return schedules.IntervalSchedule(every)
    return None


def cron_expression(schedule: Any) -> str:
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


def zone_name(tz: Any) -> str:
    name = getattr(tz, "key", None) or getattr(tz, "zone", None)
    if name:
        return str(name)
    if tz is None or tz.utcoffset(None) == timedelta(0):
        return "UTC"
    raise TaskGuardError(f"cannot name the time zone {tz!r} of a crontab")
