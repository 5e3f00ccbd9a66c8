"""django-celery-beat's ``PeriodicTask`` rows as data schedules (``manage.py import_celery_beat``).

A crontab row becomes a cron data schedule in the crontab's own time zone, with celery's
day rule (a day must match the day of month *and* the day of week when both are
restricted: ``cron_day_or=False``); an interval row becomes ``every``. Clocked, solar and
one-off rows have no repeating slots and are refused, each with its reason.

No slot runs twice during the switch: the row's ``last_run_at`` becomes the schedule's
``first_seen`` (no slot before it fires), and a row a ``TaskguardDatabaseScheduler`` beat
already fired (a ``TaskSchedule`` of source ``celery`` declared in django-celery-beat,
``task[name]``) is converted in place: same identity, so the ledger refuses a slot that ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery.schedules import crontab
from croniter import CroniterError, croniter

from ...data_schedules import validate
from ...exceptions import TaskGuardError
from .entries import DJANGO_CELERY_BEAT
from .headers import cron_expression, zone_name

__all__ = ["ADOPTS", "REASON", "Imported", "Refused", "convert", "describe", "not_carried"]

REASON = "imported from django-celery-beat"
# The schedules an import may take over: the entries TaskguardDatabaseScheduler saved.
ADOPTS = (DJANGO_CELERY_BEAT,)
# ``PeriodicTask`` fields a data schedule has no place for, with their unset values.
NOT_CARRIED = {
    "queue": (None, ""),
    "exchange": (None, ""),
    "routing_key": (None, ""),
    "headers": (None, "", "{}"),
    "priority": (None,),
    "expire_seconds": (None,),
}


_AFTER = timedelta(microseconds=1)


class Refused(Exception):
    """A row that cannot be a data schedule; the message says why."""


@dataclass(frozen=True)
class Imported:
    """A row as a data schedule: its task name (``target[name]``), the values
    ``ledger.schedules.define`` saves, and its ``first_seen``: just after the row's last run
    (django-celery-beat sent every slot due at or before it; slots are whole seconds, so
    the microsecond added only keeps a slot equal to the last run from firing again)."""

    name: str
    task_name: str
    values: dict[str, Any]
    first_seen: datetime | None


def not_carried(row: Any) -> list[str]:
    """The fields set on ``row`` that a data schedule does not carry."""
    return [field for field, unset in NOT_CARRIED.items() if getattr(row, field) not in unset]


def convert(row: Any) -> Imported:
    """The data schedule of the ``PeriodicTask`` ``row``; raises :class:`Refused`."""
    timing = _timing(row)
    try:
        args = _json(row.args, "args", list)
        kwargs = _json(row.kwargs, "kwargs", dict)
        task_name, values = validate(
            row.name,
            row.task,
            args=args,
            kwargs=kwargs,
            enabled=bool(row.enabled),
            starts=row.start_time,
            ends=row.expires,
            description=row.description or "",
            **timing,
        )
    except TaskGuardError as exc:
        raise Refused(str(exc)) from None
    last_run = row.last_run_at
    return Imported(row.name, task_name, values, last_run and last_run + _AFTER)


def describe(values: dict[str, Any]) -> str:
    """A data schedule's timing in a few words, for the command's output."""
    if values["every"] is not None:
        return f"every {values['every']}"
    days = values["cron"].split()[2::2]  # day of month, day of week
    both = not values["cron_day_or"] and "*" not in days
    rule = ", day of month and day of week both" if both else ""
    return f'cron "{values["cron"]}" in {values["time_zone"]}{rule}'


def _timing(row: Any) -> dict[str, Any]:
    """``validate``'s keywords for the row's schedule."""
    if row.one_off:
        raise Refused(
            "a one-off task (one_off) runs once and is then disabled; a data schedule fires "
            "every slot: use the admin's run now, or define_schedule with starts/ends"
        )
    if row.clocked_id is not None:
        raise Refused(
            "a clocked schedule fires once at a set time and has no repeating slots; use "
            "the admin's run now, or a cron with starts/ends"
        )
    if row.solar_id is not None:
        raise Refused(
            "a solar schedule (sunrise, sunset... at a place) has no slots taskguard can "
            "compute the same way in every copy; use a cron in the place's time zone"
        )
    if row.crontab_id is not None:
        return _crontab(row.crontab)
    if row.interval_id is not None:
        interval = row.interval
        try:
            return {"every": timedelta(**{str(interval.period): int(interval.every)})}
        except (TypeError, ValueError, OverflowError) as exc:
            raise Refused(f"its interval {interval} cannot be read ({exc})") from None
    raise Refused("it has no schedule (no crontab, interval, clocked or solar)")


def _crontab(schedule: Any) -> dict[str, Any]:
    try:
        parsed = crontab(
            minute=schedule.minute,
            hour=schedule.hour,
            day_of_week=schedule.day_of_week,
            day_of_month=schedule.day_of_month,
            month_of_year=schedule.month_of_year,
        )
        zone = zone_name(schedule.timezone)
    except (TaskGuardError, ValueError) as exc:
        raise Refused(f"its crontab {schedule} cannot be read ({exc})") from None
    written = (
        schedule.minute,
        schedule.hour,
        schedule.day_of_month,
        schedule.month_of_year,
        schedule.day_of_week,
    )
    fields = cron_expression(parsed).split()
    cron = " ".join(
        _as_written(str(text), field, n)
        for n, (text, field) in enumerate(zip(written, fields, strict=True))
    )
    return {"cron": cron, "cron_day_or": False, "time_zone": zone}


def _as_written(text: str, parsed: str, position: int) -> str:
    """The crontab's field as the user wrote it (``*/5``, ``mon-fri``) when cron reads it
    as the same values celery does; celery's values (``0,5,...,55``) otherwise."""
    text = "".join(text.split())
    if parsed == "*":
        return parsed
    probe = ["*"] * 5
    probe[position] = text
    try:
        expanded = croniter(" ".join(probe)).expanded[position]
    except (CroniterError, ValueError):
        return parsed
    same = expanded != ["*"] and {str(value) for value in expanded} == set(parsed.split(","))
    return text if same else parsed


def _json(text: Any, field: str, kind: type) -> Any:
    try:
        value = json.loads(text or ("[]" if kind is list else "{}"))
    except ValueError as exc:
        raise Refused(f"its {field} are not JSON ({exc})") from None
    if not isinstance(value, kind):
        expected = "list" if kind is list else "object"
        raise Refused(f"its {field} must be a JSON {expected}, not {text}")
    return value
