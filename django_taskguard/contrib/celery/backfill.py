"""``manage.py backfill`` for a Celery beat entry: one stamped message per slot.

The schedule is a ``TaskSchedule`` row of source ``celery`` (the beat schedulers register
each entry), whose runs are recorded under ``task[entry]``. Each message is the one the
beat sends for the entry, from where the entry is declared: the task, its arguments and
its options (``CELERY_BEAT_SCHEDULE``, read as the current Celery app's
``beat_schedule``; or the django-celery-beat ``PeriodicTask`` named after the entry). It
carries the beat's headers (``taskguard_slot``, ``taskguard_schedule``) and
``taskguard_backfill``: the worker applies no lateness policy to it, as to any operator's
call, so ``catchup="none"`` does not record it ``missed``, and a slot the sweep recorded
``missed`` is taken over once (``missed -> running``).

A slot with no row is handed out like a django.tasks slot (:func:`handoff.hand_out`): a
``pending`` row first, so that a message that is lost is recorded ``missed`` by the sweep,
and a send that raises gives the row back. A missed slot keeps its row; the message is
sent alone (lost, the row stays ``missed``).

A data schedule of a Celery task (:mod:`.data_entries`) is sent the same way, from its row
(its task, arguments, name and version: ``taskguard_version``), for ``backfill`` and for
"run now" (a manual slot, :data:`data_schedules.RUNNERS`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Self

from celery import current_app
from celery.app import app_or_default
from celery.result import EagerResult

from ... import data_schedules
from ...exceptions import TaskGuardError
from ...handoff import DATA_SENDERS, SENDERS, hand_out
from ...models import ScheduleSource, TargetKind, TaskSchedule
from .headers import (
    BACKFILL_HEADER,
    PERIODIC_TASK_HEADER,
    SCHEDULE_HEADER,
    SLOT_HEADER,
    UTC,
    VERSION_HEADER,
    task_identity,
)

BEAT_SCHEDULE = "CELERY_BEAT_SCHEDULE"
DJANGO_CELERY_BEAT = "django-celery-beat"
# What a backfilled message does not take from its entry: ``expires`` bounds how long the
# beat's message of a due slot may wait; a backfilled slot is past, and would be dropped.
DROPPED_OPTIONS = ("expires",)
PERIODIC_TASK_OPTIONS = ("queue", "exchange", "routing_key", "priority")
# The name of the app Celery makes when a process (or thread) has none of its own.
FALLBACK_APP = "default"


@dataclass(frozen=True)
class BeatMessage:
    """What the beat sends for one entry (its slot headers aside)."""

    task: str  # the Celery task name
    entry: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


def beat_message(schedule: TaskSchedule) -> BeatMessage:
    """The message of ``schedule``'s beat entry, read where it is declared now.

    Raises ``TaskGuardError`` naming the entry when it no longer exists, cannot be read,
    or now sends another task than the one its runs are recorded under.
    """
    if schedule.declared_in == DJANGO_CELERY_BEAT:
        message = _periodic_task(schedule.entry)
    else:
        message = _settings_entry(schedule.entry)
    recorded_as = task_identity(message.task, message.entry)
    if recorded_as != schedule.task_name:
        raise TaskGuardError(
            f"beat entry {schedule.entry!r} now sends {message.task}, whose runs are recorded "
            f"as {recorded_as}, not {schedule.task_name}: backfill {recorded_as} instead"
        )
    return message


def _settings_entry(name: str) -> BeatMessage:
    app: Any = current_app
    beat_schedule = app.conf.beat_schedule or {}
    entry = beat_schedule.get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get("task"), str):
        hint = (
            f" (Celery app {app.main!r} has no beat schedule at all: is your Celery app "
            f"imported by your project's __init__.py, as Celery's Django guide shows?)"
            if not beat_schedule
            else ""
        )
        raise TaskGuardError(
            f"beat entry {name!r} is not in {BEAT_SCHEDULE} any more{hint}; nothing to backfill"
        )
    options = {k: v for k, v in (entry.get("options") or {}).items() if k not in DROPPED_OPTIONS}
    return BeatMessage(
        task=entry["task"],
        entry=name,
        args=tuple(_evaluated(value) for value in entry.get("args") or ()),
        kwargs={key: _evaluated(value) for key, value in (entry.get("kwargs") or {}).items()},
        options=options,
    )


def _evaluated(value: Any) -> Any:
    """An entry argument as the beat sends it (a ``BeatLazyFunc`` is called at send time)."""
    from celery.beat import BeatLazyFunc  # beat code is loaded where it is used

    return value() if isinstance(value, BeatLazyFunc) else value


def _periodic_task(name: str) -> BeatMessage:
    try:
        from django_celery_beat.models import PeriodicTask
    except ImportError as exc:
        raise TaskGuardError(
            f"beat entry {name!r} is a django-celery-beat periodic task, and "
            f"django-celery-beat cannot be imported here ({exc})"
        ) from exc
    row = PeriodicTask.objects.filter(name=name).first()
    if row is None:
        raise TaskGuardError(
            f"beat entry {name!r} is not a django-celery-beat periodic task any more; "
            f"nothing to backfill"
        )
    args, kwargs, headers = (
        _json(name, "args", row.args, "[]", list),
        _json(name, "kwargs", row.kwargs, "{}", dict),
        _json(name, "headers", row.headers, "{}", dict),
    )
    options = {k: getattr(row, k) for k in PERIODIC_TASK_OPTIONS if getattr(row, k) is not None}
    options["headers"] = {**headers, PERIODIC_TASK_HEADER: row.name}
    return BeatMessage(task=row.task, entry=name, args=tuple(args), kwargs=kwargs, options=options)


def _json(name: str, what: str, text: str | None, empty: str, kind: type) -> Any:
    try:
        value = json.loads(text or empty)
    except ValueError as exc:
        raise TaskGuardError(f"periodic task {name!r}: its {what} are not JSON ({exc})") from exc
    if not isinstance(value, kind):
        raise TaskGuardError(
            f"periodic task {name!r}: its {what} must be a JSON {kind.__name__}, got {text!r}"
        )
    return value


class _Sender:
    """A schedule's slots sent as stamped messages (a :class:`handoff.SlotSender`), over one
    broker connection of the current Celery app; subclasses say how one slot is sent."""

    def __init__(self, task_name: str, by: str) -> None:
        self.task_name = task_name
        self.by = by or "backfill"
        self.app: Any = None
        self._broker: Any = None

    def __enter__(self) -> Self:
        self.app = sending_app()
        self._broker = self.app.connection_for_write()
        return self

    def __exit__(self, *exc_info: object) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.release()

    def hand_out(self, slot: datetime, *, missed: bool) -> str:
        """Send the message of ``slot``: a missed row keeps its row (the worker takes it
        over), a slot with no row gets a ``pending`` one first (``handoff.hand_out``)."""
        if missed:
            return f"enqueued ({self._send(slot)}); its missed row is taken over by the worker"
        return hand_out(self.task_name, slot, functools.partial(self._send, slot))

    def _send(self, slot: datetime) -> str:
        raise NotImplementedError


class BeatSender(_Sender):
    """A beat entry's slots."""

    def __init__(self, schedule: TaskSchedule, by: str) -> None:
        super().__init__(schedule.task_name, by)
        self.message = beat_message(schedule)

    def _send(self, slot: datetime) -> str:
        message = self.message
        headers = {
            **(message.options.get("headers") or {}),
            SLOT_HEADER: slot.astimezone(UTC).isoformat(),
            SCHEDULE_HEADER: message.entry,
            BACKFILL_HEADER: self.by,
        }
        options = {**message.options, "headers": headers}
        app = self.app
        task = app.tasks.get(message.task)  # its own options apply, as when the beat sends it
        publish: Callable[..., Any] = (
            task.apply_async if task is not None else functools.partial(app.send_task, message.task)
        )
        result = publish(message.args, message.kwargs, connection=self._broker, **options)
        return sent(app, result, self._broker)


# --- data schedules of Celery tasks: run now and backfill -------------------------------


def sending_app() -> Any:
    """The Celery app that sends an operator's messages: the current one, unless it is
    Celery's fallback app (``Celery("default", fixups=[])``, made when this process, or this
    thread, has no app of its own), whose broker is whatever Celery defaults to, not
    necessarily the workers': a ``TaskGuardError`` says so instead."""
    app: Any = app_or_default()
    if app.main == FALLBACK_APP and not app.fixups:
        with app.connection_for_write() as broker:
            where = broker.as_uri()
        raise TaskGuardError(
            f"not sent: the Celery app here is Celery's fallback app (broker {where}), not "
            f"your project's, so your workers may never see the message; create your Celery "
            f"app where Django starts (import it in your project's __init__.py, as Celery's "
            f"Django guide shows) or call its set_default()"
        )
    return app


def sent(app: Any, result: Any, connection: Any = None) -> str:
    """What is known of a message just sent: its id, and the broker and app it went
    through (or that it ran here: ``task_always_eager``). That a worker takes it is not
    known yet: its row stays ``pending`` until one does."""
    if isinstance(result, EagerResult):
        return f"celery message {result.id}, run in this process (task_always_eager)"
    if connection is not None:
        where = connection.as_uri()
    else:
        with app.connection_for_write() as broker:
            where = broker.as_uri()
    return (
        f"celery message {result.id} sent to broker {where} by Celery app {app.main!r}; "
        f"no worker has taken it yet"
    )


def send_slot(row: TaskSchedule, slot: datetime, by: str, connection: Any = None) -> str:
    """Send one slot of the data schedule ``row`` as an operator's message (no lateness
    policy: ``taskguard_backfill``), with its name and version; say where it went."""
    headers = {
        SLOT_HEADER: slot.astimezone(UTC).isoformat(),
        SCHEDULE_HEADER: row.entry,
        VERSION_HEADER: row.version,
        BACKFILL_HEADER: by or "operator",
    }
    app = sending_app()
    task = app.tasks.get(row.function)
    publish: Any = (
        task.apply_async if task is not None else functools.partial(app.send_task, row.function)
    )
    result = publish(tuple(row.args), dict(row.kwargs), headers=headers, connection=connection)
    return sent(app, result, connection)


def run_now(row: TaskSchedule, slot: datetime, by: str) -> str:
    """ "Run now" of a Celery data schedule: a ``pending`` row, then the message to a worker."""
    return hand_out(row.task_name, slot, functools.partial(send_slot, row, slot, by))


class DataSender(_Sender):
    """``manage.py backfill`` of a Celery data schedule."""

    def __init__(self, row: TaskSchedule, by: str) -> None:
        if row.removed_at is not None:
            raise TaskGuardError(f"data schedule {row.task_name} was deleted; nothing to backfill")
        super().__init__(row.task_name, by)
        self.row = row

    def _send(self, slot: datetime) -> str:
        return send_slot(self.row, slot, self.by, self._broker)


def register() -> None:
    """Let ``backfill`` send the slots of beat entries and of Celery data schedules, "run
    now" hand out a Celery data schedule's slot, and data schedules name Celery tasks
    (idempotent)."""
    SENDERS[ScheduleSource.CELERY] = BeatSender
    DATA_SENDERS[TargetKind.CELERY] = DataSender
    data_schedules.RUNNERS[TargetKind.CELERY] = run_now
    if celery_target not in data_schedules.BY_NAME:
        data_schedules.BY_NAME.append(celery_target)
    if beat_entry_holding not in data_schedules.HELD_BY:
        data_schedules.HELD_BY.append(beat_entry_holding)


def beat_entry_holding(task_name: str) -> str | None:
    """The entry of the current Celery app's beat_schedule whose runs are recorded as
    ``task_name``, said; None when there is none."""
    app: Any = current_app
    for name, entry in (app.conf.beat_schedule or {}).items():
        task = entry.get("task") if isinstance(entry, dict) else None
        if isinstance(task, str) and task_identity(task, name) == task_name:
            return f"beat entry {name!r} in {BEAT_SCHEDULE}"
    return None


def celery_target(name: str) -> data_schedules.Target | None:
    """A data schedule's target that is a task of the current Celery app (its modules
    imported, as a worker does), its body guarded; None: no such task."""
    from celery import current_app

    tasks = current_app.tasks
    if name not in tasks:
        try:
            current_app.loader.import_default_modules()
        except Exception:
            return None
    task = tasks.get(name)
    if task is None:
        return None
    body = getattr(task, "__wrapped__", None)
    return data_schedules.guarded_target(
        name, TargetKind.CELERY, body, task, task.run, decorator="@shared_task"
    )
