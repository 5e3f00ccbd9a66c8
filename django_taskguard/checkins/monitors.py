"""Which monitor a task checks in to, per service, and what Sentry should know of its schedule.

Slugs: ``TASKGUARD["CHECKINS"]["monitors"]`` maps a task name to ``False`` (no check-ins),
one slug for every service, or a dict of service -> slug or ``False``. A task it does not
name (or a service its dict does not name) gets :func:`default_slug`.

Schedules are read from the ledger's ``TaskSchedule`` rows (every schedule is registered
there), by the sending thread only, and kept for :data:`SCHEDULE_TTL` seconds per process.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

from django.utils import timezone

from .. import data_schedules
from ..ledger import schedules as schedule_store
from ..schedules import rebuild

SLUG_MAX_LENGTH = 50  # Sentry's limit; Healthchecks and Cronitor take these too
SCHEDULE_TTL = 300.0
MAX_RUNTIME_MINUTES = 10_080  # what Sentry accepts (a week)
GAP_SLOTS = 100  # slots read to find the shortest gap between two (the derived max_runtime)
# Where those slots are read from: a fixed date, so that max_runtime is the same every day.
GAP_BASE = datetime(2001, 1, 1, tzinfo=UTC)
# Interval units Sentry's monitor_config takes, largest first, in minutes.
_UNITS = (("day", 1440), ("hour", 60), ("minute", 1))

_schedules: dict[str, tuple[float, dict[str, Any] | None]] = {}


def default_slug(task_name: str) -> str:
    """A slug made from the task name: lowercase, ``[a-z0-9_-]``, at most 50 characters.

    Any other character becomes ``-``. A name too long is cut and ends with a digest of the
    whole name, so two long names sharing a prefix get two slugs; the same name always gets
    the same slug. (``a.b`` and ``a-b`` share one: name a slug in ``monitors`` for either.)
    """
    slug = re.sub(r"[^a-z0-9_-]+", "-", task_name.lower()).strip("-") or "task"
    if len(slug) <= SLUG_MAX_LENGTH:
        return slug
    digest = hashlib.sha256(task_name.encode()).hexdigest()[:8]
    return f"{slug[: SLUG_MAX_LENGTH - 9].rstrip('-')}-{digest}"


def slug(settings: dict[str, Any], task_name: str, service: str) -> str | None:
    """The monitor slug ``task_name`` checks in to at ``service``; None: no check-ins."""
    chosen = settings.get("monitors", {}).get(task_name)
    if chosen is False:
        return None
    if isinstance(chosen, str):
        return chosen
    if isinstance(chosen, dict) and service in chosen:
        value = chosen[service]
        return None if value is False else str(value)
    return default_slug(task_name)


def opted_out(settings: dict[str, Any], task_name: str) -> bool:
    """True when ``task_name`` checks in nowhere (``monitors`` says ``False``)."""
    return settings.get("monitors", {}).get(task_name) is False


def schedule_of(task_name: str) -> dict[str, Any] | None:
    """The task's schedule, as Sentry's ``monitor_config`` words it (None: no row, or a
    schedule Sentry cannot express); read once per :data:`SCHEDULE_TTL` per process."""
    now = time.monotonic()
    cached = _schedules.get(task_name)
    if cached is not None and cached[0] > now:
        return cached[1]
    row = schedule_store.get(task_name)
    config = (
        None
        if row is None
        else monitor_config(
            row.cron,
            row.cron_day_or,
            schedule_store.zone_of(row),
            row.every,
            data_schedules.grace_of(row),
        )
    )
    if len(_schedules) > 10_000:
        _schedules.clear()
    _schedules[task_name] = (now + SCHEDULE_TTL, config)
    return config


def forget_schedules() -> None:
    """Read every schedule anew on its next check-in (tests; a changed schedule)."""
    _schedules.clear()


def monitor_config(
    cron: str, day_or: bool, zone: str, every: timedelta | None, grace: timedelta
) -> dict[str, Any] | None:
    """Sentry's ``monitor_config`` for a stored schedule, without ``max_runtime`` (see
    :func:`with_runtime`); None for an interval Sentry cannot express (under a minute, or
    not a whole number of minutes): Sentry counts intervals in whole minutes at least."""
    if cron and not day_or and _both_days_restricted(cron):
        return None  # Celery's day_or=False: Sentry would read the days with OR
    if cron:
        config: dict[str, Any] = {"schedule": {"type": "crontab", "value": cron}}
        config["timezone"] = zone or timezone.get_default_timezone_name()
    elif every is not None:
        seconds = every.total_seconds()
        if seconds < 60 or seconds % 60:
            return None
        minutes = int(seconds // 60)
        unit, size = next((u, s) for u, s in _UNITS if minutes % s == 0)
        config = {"schedule": {"type": "interval", "value": minutes // size, "unit": unit}}
        config["timezone"] = "UTC"
    else:
        return None
    config["checkin_margin"] = max(1, math.ceil(grace.total_seconds() / 60))
    gap = _gap_minutes(cron, day_or, zone, every)
    if gap is not None:
        config["max_runtime"] = gap
    return config


def _both_days_restricted(cron: str) -> bool:
    """Whether both day fields of ``cron`` are restricted: only then do AND (Celery's
    ``day_or=False``) and OR (standard cron, Sentry) read them differently."""
    fields = cron.split()
    return len(fields) >= 5 and fields[2] != "*" and fields[4] != "*"


def _gap_minutes(cron: str, day_or: bool, zone: str, every: timedelta | None) -> int | None:
    """The shortest time between two of ``GAP_SLOTS`` slots, in whole minutes (a run longer
    than that may overlap its next slot: the derived ``max_runtime``), within what Sentry
    accepts. Read on the wall clock (the schedule's zone's daylight-saving shifts aside) from
    a fixed date, so that it is the same whatever the day it is asked: a nightly job's
    ``max_runtime`` is 1440, not 1380 in the weeks before a spring-forward."""
    try:
        built = rebuild(cron, day_or, "UTC", every)
        slots = built.slots_between(GAP_BASE, GAP_BASE + timedelta(days=400), GAP_SLOTS)
    except Exception:  # a schedule that cannot be read: Sentry's default
        return None
    if len(slots) < 2:  # fires less than twice a year
        return None
    shortest = min(b - a for a, b in pairwise(slots))
    minutes = math.ceil(shortest.total_seconds() / 60)
    return max(1, min(MAX_RUNTIME_MINUTES, minutes))
