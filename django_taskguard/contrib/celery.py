"""Celery glue: beat schedulers that stamp each message with its slot, and the
worker-side slot source that reads it.

Beat side: ``TaskguardScheduler`` (``beat_schedule`` in settings) and
``TaskguardDatabaseScheduler`` (django-celery-beat) add two headers to every
message they publish: ``taskguard_slot`` (ISO-8601 UTC, the fire time the
entry was due for) and ``taskguard_schedule`` (the entry's name). Interval
entries fire on epoch-aligned multiples of their interval, so every beat,
whenever it started, fires and stamps the same slots. They live in
``celery_beat`` and ``celery_beat_db`` and are loaded from here on first use
(``CELERY_BEAT_SCHEDULER = "django_taskguard.contrib.celery:TaskguardScheduler"``).

Worker side (this module): a guarded Celery task (``@shared_task`` over
``@once_per_schedule()``) takes its slot from ``taskguard_slot`` and its
identity from the Celery task name plus the schedule name
(``"app.tasks.report[nightly-eu]"``, see :func:`task_identity`). Retries and
redeliveries of the message are attempts on the same row.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import partial
from typing import Any, NoReturn, cast

from celery import Task
from celery._state import get_current_task
from celery.exceptions import Ignore, Reject, Retry
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from django.utils import timezone

from .. import guard, ledger, schedules
from ..conf import taskguard_settings
from ..context import _current
from ..decorators import SLOT_SOURCES, CallContext
from ..exceptions import TaskGuardError
from ..models import TASK_NAME_MAX_LENGTH
from ..states import RunState

__all__ = [
    "DEFERRED_HEADER",
    "SCHEDULE_HEADER",
    "SLOT_HEADER",
    "celery_call_context",
    "slot_for",
    "task_identity",
]

logger = logging.getLogger("taskguard.celery")

UTC = dt_timezone.utc
SLOT_HEADER = "taskguard_slot"
SCHEDULE_HEADER = "taskguard_schedule"
PERIODIC_TASK_HEADER = "periodic_task_name"  # django-celery-beat's own header
DEFERRED_HEADER = "taskguard_deferred"  # how often a redelivery was put back
BEAT_CLAIM_TTL = 3600  # seconds a beat's claim on (entry, slot) is kept in Redis


# --- identity and slots -------------------------------------------------------------


def task_identity(task_name: str, schedule_name: str | None) -> str:
    """The ``TaskRun.task_name`` of a Celery task sent for one schedule entry.

    ``"app.tasks.report[nightly-eu]"``: the Celery task name, and the beat
    entry's (or django-celery-beat periodic task's) name in brackets, so that
    one Celery task backing several schedules runs once per slot *per
    schedule*. No schedule name, or one equal to the task name: the task name
    alone. Longer than 255 characters: cut, with ``~`` and 16 hex digits of
    the full name's SHA-256 at the end (stable, and distinct in practice).
    """
    if not schedule_name or schedule_name == task_name:
        return task_name
    full = f"{task_name}[{schedule_name}]"
    if len(full) <= TASK_NAME_MAX_LENGTH:
        return full
    digest = hashlib.sha256(full.encode("utf-8")).hexdigest()[:16]
    return f"{full[: TASK_NAME_MAX_LENGTH - 17]}~{digest}"


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
        expression = schedules.celery_cron_expression(schedule)
        cron = schedules.CronSchedule(expression, tz_name=zone_name(schedule.tz), day_or=False)
        return cron.latest_slot(now)
    if isinstance(schedule, interval_schedule):
        return _interval_slot(schedule, now)
    if isinstance(schedule, schedules.Schedule):
        return schedule.latest_slot(now)
    return None


def _interval_slot(schedule: Any, now: datetime) -> datetime | None:
    every: timedelta = schedule.run_every
    if every < timedelta(seconds=1):
        return None
    return schedules.IntervalSchedule(every).latest_slot(now)


def zone_name(tz: Any) -> str:
    name = getattr(tz, "key", None) or getattr(tz, "zone", None)
    if name:
        return str(name)
    if tz is None or tz.utcoffset(None) == timedelta(0):
        return "UTC"
    raise TaskGuardError(f"cannot name the time zone {tz!r} of a crontab")


# --- worker side ------------------------------------------------------------------


def celery_call_context() -> CallContext | None:
    """The slot source for guarded Celery tasks (registered in ``SLOT_SOURCES``).

    Answers only for the body of the Celery task being executed, and only when
    that body is a guarded function and no guarded run is active yet (so a
    guarded function called *from* a task body keeps its own name and slot).
    """
    task = get_current_task()
    if task is None or _current.get() is not None:
        return None
    guarded = _guarded_body(task)
    if guarded is None:
        return None
    request = task.request
    headers = message_headers(request)
    schedule_name = headers.get(SCHEDULE_HEADER) or headers.get(PERIODIC_TASK_HEADER)
    name = task_identity(task.name, schedule_name)
    if request.called_directly:
        return CallContext(task_name=name)
    slot = headers.get(SLOT_HEADER)
    if slot is None and guarded.schedule is None:
        record_no_slot(guarded.task_name or name, request)
    return CallContext(
        slot=slot,
        task_name=name,
        will_retry=partial(will_retry, task, request),
        on_busy=partial(defer, task, request) if _may_be_stranded(request, headers) else None,
    )


def _guarded_body(task: Task[Any, Any]) -> Any:
    body = getattr(task, "_orig_run", None) or task.run  # autoretry_for swaps ``run``
    if isinstance(getattr(body, "policy", None), guard.Policy) and hasattr(body, "run_for_slot"):
        return body
    return None


def message_headers(request: Any) -> dict[str, Any]:
    """The taskguard headers of a request: in ``request.headers`` (eager, retries) or
    as request attributes (a worker merges message headers into the request)."""
    headers = dict(getattr(request, "headers", None) or {})
    for name in (SLOT_HEADER, SCHEDULE_HEADER, PERIODIC_TASK_HEADER, DEFERRED_HEADER):
        value = getattr(request, name, None)
        if value is not None:
            headers.setdefault(name, value)
    return headers


def will_retry(task: Task[Any, Any], request: Any, exc: BaseException) -> bool:
    """True when Celery will run this message again after ``exc``.

    ``autoretry_for`` (minus ``dont_autoretry_for``) while retries are left
    (``retry_kwargs["max_retries"]`` or the task's ``max_retries``; None is
    unlimited), and ``Reject(requeue=True)``.
    """
    if isinstance(exc, Reject):
        return bool(getattr(exc, "requeue", False))
    if isinstance(exc, (Ignore, Retry)) or request.called_directly:
        return False
    autoretry_for = tuple(getattr(task, "autoretry_for", ()) or ())
    if not autoretry_for or not isinstance(exc, autoretry_for):
        return False
    dont = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if dont and isinstance(exc, dont):
        return False
    retry_kwargs = getattr(task, "retry_kwargs", None) or {}
    max_retries = retry_kwargs.get("max_retries", task.max_retries)
    return max_retries is None or request.retries + 1 <= max_retries


def _may_be_stranded(request: Any, headers: dict[str, Any]) -> bool:
    """A message that may be the only one left for its slot while another attempt's
    lease still runs: a broker redelivery (its worker may be dead), a message we
    put back before, or a retry (it may overtake the end of its own previous
    attempt). Such a message is put back, never acked as a duplicate."""
    if request.is_eager:
        return False
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    return redelivered or DEFERRED_HEADER in headers or bool(request.retries)


def defer(task: Task[Any, Any], request: Any, seconds_left: float) -> NoReturn:
    """Put the message back until the live attempt's lease has run out.

    Republishes the same task id with the same headers (and the same retry
    count: this is not a Celery retry of the body) and a countdown, then raises
    ``Retry`` so the worker acks this copy. When it comes back, the slot has
    either ended (the message is a plain duplicate) or its owner is dead (the
    lease expired: on_stale decides, takeover or ``abandoned``).
    """
    countdown = max(1.0, seconds_left + 1.0)
    headers = dict(request.headers or {})
    headers.update(message_headers(request))
    headers[DEFERRED_HEADER] = int(headers.get(DEFERRED_HEADER) or 0) + 1
    signature = task.signature_from_request(
        request, request.args, request.kwargs, countdown=countdown, headers=headers
    )
    signature.apply_async()
    logger.warning(
        "taskguard: %s slot %s is held by a live attempt; message %s (redelivered or "
        "retried) put back for %.1fs",
        task.name,
        headers.get(SLOT_HEADER),
        request.id,
        countdown,
    )
    raise Retry(
        f"taskguard: the slot is held by a live attempt; checking again in {countdown:.1f}s",
        when=cast(Any, countdown),
        sig=signature,
    )


def record_no_slot(task_name: str, request: Any) -> NoReturn:
    """Record a message that has no slot as a ``skipped`` run, then raise.

    The row is keyed by the time the worker received the message (there is no
    slot to key it by); its error says which task id came without a slot.
    """
    reason = (
        f"no slot: message {request.id} carried no {SLOT_HEADER} header (not sent by a "
        f"taskguard beat scheduler) and the task has no cron=, every= or schedule="
    )
    alias = taskguard_settings.DATABASE_ALIAS
    ledger.ensure_autocommit(alias)
    owner = guard.new_owner()
    row = ledger.claim(alias, task_name, timezone.now(), owner, 60, abandon_is_final=True)
    if row.owner == owner:
        ledger.change(
            alias,
            row,
            [ledger.Step(RunState.SKIPPED, reason[:500])],
            actor=owner,
            sets=ledger.finish_assignments(alias, reason),
        )
    raise TaskGuardError(f"{task_name!r} did not run: {reason} (recorded as run {row.id})")


if celery_call_context not in SLOT_SOURCES:
    SLOT_SOURCES.append(celery_call_context)


_BEAT = {
    "EpochInterval",
    "StampingMixin",
    "TaskguardEntry",
    "TaskguardScheduler",
    "aligned",
    "beat_claim",
    "warn_timezone",
}


def __getattr__(name: str) -> Any:
    # The schedulers live in their own modules, loaded on first use: beat code
    # has no place in a worker, and django-celery-beat's models can only be
    # imported once apps are ready (and only when it is installed).
    if name in _BEAT:
        from . import celery_beat

        return getattr(celery_beat, name)
    if name in ("TaskguardDatabaseScheduler", "TaskguardModelEntry"):
        from . import celery_beat_db

        return getattr(celery_beat_db, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
