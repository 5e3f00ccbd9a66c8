"""Celery glue: beat schedulers that stamp each message with its slot, and the
worker-side slot source that reads it.

Beat side: ``TaskguardScheduler`` (``beat_schedule`` in settings) and
``TaskguardDatabaseScheduler`` (django-celery-beat) add two headers to every
message they publish: ``taskguard_slot`` (ISO-8601 UTC, the fire time the
entry was due for) and ``taskguard_schedule`` (the entry's name). Interval
entries fire on epoch-aligned multiples of their interval, so every beat,
whenever it started, fires and stamps the same slots.

Worker side: a guarded Celery task (``@shared_task`` over
``@once_per_schedule()``) takes its slot from ``taskguard_slot`` and its
identity from the Celery task name plus the schedule name
(``"app.tasks.report[nightly-eu]"``, see :func:`task_identity`). Retries and
redeliveries of the message are attempts on the same row.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import partial
from typing import Any, NoReturn, cast

from celery import Task
from celery._state import get_current_task
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.exceptions import Ignore, Reject, Retry
from celery.schedules import crontab, schedstate
from celery.schedules import schedule as interval_schedule
from django.utils import timezone

from .. import guard, ledger, schedules
from ..conf import taskguard_settings
from ..context import _current
from ..decorators import SLOT_SOURCES, CallContext
from ..exceptions import TaskGuardError
from ..locks.base import slot_label, task_digest
from ..models import TASK_NAME_MAX_LENGTH
from ..states import RunState

__all__ = [
    "DEFERRED_HEADER",
    "SCHEDULE_HEADER",
    "SLOT_HEADER",
    "TaskguardEntry",
    "TaskguardScheduler",
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
        cron = schedules.CronSchedule(expression, tz_name=_zone_name(schedule.tz), day_or=False)
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


def _zone_name(tz: Any) -> str:
    name = getattr(tz, "key", None) or getattr(tz, "zone", None)
    if name:
        return str(name)
    if tz is None or tz.utcoffset(None) == timedelta(0):
        return "UTC"
    raise TaskGuardError(f"cannot name the time zone {tz!r} of a crontab")


# --- beat side -------------------------------------------------------------------


class EpochInterval(interval_schedule):
    """A celery interval that is due on multiples of ``run_every`` since the epoch.

    Celery's own interval is due ``run_every`` after the entry last ran, so two
    beats started at different times fire at different moments (and drift).
    This one is due once per epoch-aligned slot that began after the entry
    last ran: every beat fires at the same instants and stamps the same slot.
    """

    run_every: timedelta

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = self.maybe_make_aware(self.now()).astimezone(UTC)
        slot = schedules.IntervalSchedule(self.run_every).latest_slot(now)
        until_next = (slot + self.run_every - now).total_seconds()
        last = self.maybe_make_aware(last_run_at).astimezone(UTC)
        return schedstate(is_due=last < slot, next=until_next)


def aligned(schedule: Any) -> Any:
    """``schedule`` with plain celery intervals of a second or more made epoch-aligned."""
    if type(schedule) is not interval_schedule:
        return schedule
    plain: Any = schedule
    if plain.run_every < timedelta(seconds=1):
        return schedule
    return EpochInterval(plain.run_every, plain.relative, nowfun=plain.nowfun, app=plain._app)


class TaskguardEntry(ScheduleEntry):
    """A ``beat_schedule`` entry whose interval is epoch-aligned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = aligned(self.schedule)


class StampingMixin:
    """Publishes each due entry with ``taskguard_slot`` / ``taskguard_schedule`` headers."""

    app: Any
    _warned: set[str]

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        if advance:
            entry = self.reserve(entry)  # type: ignore[attr-defined]
        stamped = self.stamp(entry, datetime.now(tz=UTC))
        if stamped is None:
            return None
        slot = stamped.options["headers"].get(SLOT_HEADER)
        sent: dict[str, str] = self.__dict__.setdefault("_sent_slots", {})
        if slot is not None and sent.get(entry.name) == slot:
            # django-celery-beat reloads entries from rows that other beats may not
            # have synced yet; never publish the same slot of an entry twice.
            logger.info("taskguard beat: %s slot %s already sent by this beat", entry.name, slot)
            return None
        result = super().apply_async(  # type: ignore[misc]
            stamped, producer=producer, advance=False, **kwargs
        )
        if slot is not None:
            sent[entry.name] = slot
        return result

    def stamp(self, entry: Any, now: datetime) -> Any:
        """A copy of ``entry`` that carries the slot headers; None: another beat sent it."""
        try:
            slot = slot_for(entry.schedule, now)
        except Exception:
            logger.exception("taskguard could not compute the slot of beat entry %s", entry.name)
            slot = None
        headers = dict(entry.options.get("headers") or {})
        headers[SCHEDULE_HEADER] = entry.name
        if slot is None:
            self._warn_once(entry)
        else:
            headers[SLOT_HEADER] = slot.isoformat()
            if taskguard_settings.BEAT_CLAIM and not beat_claim(entry.task, entry.name, slot):
                logger.info(
                    "taskguard beat: %s slot %s was already sent by another beat",
                    entry.name,
                    slot.isoformat(),
                )
                return None
        # A shallow copy by hand: ScheduleEntry.__reduce__ (which copy.copy uses) does
        # not fit ModelEntry's constructor.
        stamped = object.__new__(type(entry))
        stamped.__dict__.update(entry.__dict__)
        stamped.options = {**entry.options, "headers": headers}
        return stamped

    def _warn_once(self, entry: Any) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if entry.name not in warned:
            warned.add(entry.name)
            logger.warning(
                "taskguard beat: entry %s has a schedule without slots (%r); its messages "
                "carry no taskguard_slot, so a guarded task needs its own cron=/every=",
                entry.name,
                entry.schedule,
            )


class TaskguardScheduler(StampingMixin, PersistentScheduler):
    """Celery's file-backed scheduler, stamping slots; run any number of them."""

    Entry = TaskguardEntry

    def setup_schedule(self) -> None:
        super().setup_schedule()
        warn_timezone(self.app)


def warn_timezone(app: Any) -> None:
    """Say so when crontab entries fire in a zone other than Django's ``TIME_ZONE``."""
    from django.conf import settings

    beat_zone = _zone_name(app.timezone)
    if settings.USE_TZ and beat_zone != settings.TIME_ZONE:
        logger.warning(
            "taskguard beat: celery's timezone is %s but Django's TIME_ZONE is %s; crontab "
            "entries fire (and are stamped) in %s, while @once_per_schedule(cron=...) reads "
            "cron in %s. Set CELERY_TIMEZONE = TIME_ZONE to keep them the same.",
            beat_zone,
            settings.TIME_ZONE,
            beat_zone,
            settings.TIME_ZONE,
        )


# --- BEAT_CLAIM -------------------------------------------------------------------

_claim_clients: dict[tuple[str, float], Any] = {}


def beat_claim(task_name: str, entry_name: str, slot: datetime) -> bool:
    """Claim the publishing of (entry, slot) for this beat; True also when Redis errs.

    One ``SET NX EX`` on the REDIS_ALIAS cache's server, with its own short
    socket timeout and no retries. An error means "send anyway": the worker's
    claim is the guarantee, this only saves the duplicate messages.
    """
    key = (
        f"{taskguard_settings.KEY_PREFIX}:beat:"
        f"{task_digest(task_identity(task_name, entry_name))}:{slot_label(slot)}"
    )
    owner = f"{socket.gethostname()}:{os.getpid()}"
    try:
        return bool(_claim_client().set(key, owner, nx=True, ex=BEAT_CLAIM_TTL))
    except Exception as exc:
        logger.warning("taskguard beat claim of %s failed (%s); sending anyway", key, exc)
        return True


def _claim_client() -> Any:
    alias = taskguard_settings.REDIS_ALIAS
    timeout = taskguard_settings.REDIS_SOCKET_TIMEOUT
    client = _claim_clients.get((alias, timeout))
    if client is None:
        import redis
        from django_redis import get_redis_connection

        pool = get_redis_connection(alias).connection_pool
        options = dict(pool.connection_kwargs)
        options.update(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=None,
            retry_on_timeout=False,
            retry_on_error=[],
        )
        client = redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **options)
        )
        _claim_clients[(alias, timeout)] = client
    return client


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


def __getattr__(name: str) -> Any:
    # django-celery-beat's models can only be imported once apps are ready (and
    # only when it is installed): its scheduler is loaded on first use.
    if name in ("TaskguardDatabaseScheduler", "TaskguardModelEntry"):
        from . import celery_beat_db

        return getattr(celery_beat_db, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
