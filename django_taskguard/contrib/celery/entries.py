"""Beat entries as registered schedules: what a taskguard beat fires, ``TaskSchedule`` knows.

Each entry whose task is a guarded Celery task (``@shared_task`` over
``@once_per_schedule()``) is saved as a ``TaskSchedule`` row (source ``celery``) under the
name its runs are recorded under (``task[entry]``), when the beat starts and whenever its
entries change (django-celery-beat rows are read again at run time). From then on the
missed-slot sweep, ``check_schedules``, ``health/``, the metrics, the overview and
``pause_task`` see it: a dead beat is noticed. An entry that goes away (removed from the
settings, a row disabled or deleted) is marked removed: nothing fires it any more.

An entry whose task is not guarded, or whose schedule has no slots (solar, clocked, under
a second), is not saved; the beat says so once per entry. Saving never stops the beat: a
database error is logged and the save is tried again on a later tick.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from django.utils import timezone
from django.utils.timezone import get_default_timezone_name

from ... import schedules
from ...decorating import guarded_policy
from ...ledger import schedules as store
from ...logfields import log_fields
from ...models import ScheduleSource
from .headers import cron_of, grace_of, task_identity

# Where a beat entry is declared (``TaskSchedule.declared_in``), by scheduler kind.
SETTINGS = "CELERY_BEAT_SCHEDULE"
DJANGO_CELERY_BEAT = "django-celery-beat"
# Seconds between two tries of a save that failed (the database was down).
RETRY_SECONDS = 10.0

logger = logging.getLogger("taskguard.celery")


@dataclass(frozen=True)
class BeatEntry:
    """What a scheduler knows of one entry: its name, task, schedule and headers."""

    name: str
    task: str
    schedule: Any
    headers: dict[str, Any]


class Unmonitored(Exception):
    """An entry that cannot be a registered schedule; the message says why and what to do."""


def stored_schedule(schedule: Any) -> schedules.Schedule:
    """The taskguard schedule a beat entry's ``schedule`` fires at (the slots it stamps)."""
    if isinstance(schedule, crontab):
        return cron_of(schedule)
    if isinstance(schedule, interval_schedule):
        every: timedelta = getattr(schedule, "run_every")  # noqa: B009 (untyped in stubs)
        return schedules.IntervalSchedule(every)
    raise Unmonitored(
        f"its schedule {schedule!r} has no slots taskguard can compute (solar and clocked "
        "schedules have none); use a crontab or an interval of a second or more"
    )


def guarded_body(app: Any, task_name: str) -> Any:
    """The ``@once_per_schedule`` function the Celery task ``task_name`` runs."""
    task = app.tasks.get(task_name)
    if task is None:
        try:
            app.loader.import_default_modules()  # the beat imports the tasks as a worker does
        except Exception as exc:
            raise Unmonitored(f"the app's task modules could not be imported ({exc})") from exc
        task = app.tasks.get(task_name)
    if task is None:
        raise Unmonitored(
            f"its task {task_name} is unknown to this beat; list its module in the app's "
            "include= or autodiscover_tasks()"
        )
    body = getattr(task, "__wrapped__", None)
    if guarded_policy(body) is None or not callable(getattr(body, "run_for_slot", None)):
        raise Unmonitored(
            f"its task {task_name} is not guarded; put @once_per_schedule() under "
            "@shared_task to have its slots recorded and watched"
        )
    return body


def record_of(app: Any, entry: BeatEntry, declared_in: str) -> store.Record:
    """The ``TaskSchedule`` record of ``entry``; raises :class:`Unmonitored`."""
    body = guarded_body(app, entry.task)
    try:
        described = schedules.describe(stored_schedule(entry.schedule))
    except Unmonitored:
        raise
    except Exception as exc:  # a zone that cannot be named, an interval under a second
        raise Unmonitored(f"its schedule {entry.schedule!r} cannot be stored ({exc})") from exc
    policy = body.policy
    grace = grace_of(entry.headers)
    return store.Record(
        # name= on the decorator is the whole identity (docs/celery.md, "Task identity").
        task_name=getattr(body, "task_name", None) or task_identity(entry.task, entry.name),
        source=ScheduleSource.CELERY,
        function=entry.task,
        catchup=beat_catchup(policy.catchup, grace),
        grace=grace or policy.grace,
        max_catchup=policy.max_catchup,
        pause_after_failures=policy.pause_after_failures,
        late_after=policy.late_after,
        default_zone=get_default_timezone_name(),
        entry=entry.name,
        declared_in=declared_in,
        **described,
    )


def rescheduled(records: list[store.Record]) -> list[str]:
    """The saved schedules among ``records`` whose slots the record moves (an edited entry)."""
    when = {
        row.task_name: (row.cron, row.cron_day_or, row.every, row.time_zone)
        for row in store.stored()
    }
    return [
        record.task_name
        for record in records
        if when.get(record.task_name, _slots_of(record)) != _slots_of(record)
    ]


def _slots_of(record: store.Record) -> tuple[str, bool, timedelta | None, str]:
    return (record.cron, record.cron_day_or, record.every, record.time_zone)


def beat_catchup(catchup: str, header_grace: timedelta | None) -> str:
    """What a worker does with a late message of a beat entry: an entry's
    ``taskguard_grace`` header makes it ``"none"`` (a message later than that is recorded
    missed); ``"all"`` is run-schedules' (a beat sends the latest slot once, the worker runs
    it: ``"latest"``; the sweep records the others missed, ``backfill`` runs them)."""
    if header_grace is not None:
        return "none"
    return "latest" if catchup == "all" else catchup


class Registrar:
    """Keeps one scheduler's entries in ``TaskSchedule``, retrying a save that failed."""

    def __init__(self, app: Any, declared_in: str) -> None:
        self.app = app
        self.declared_in = declared_in
        self.warned: set[str] = set()
        self.pending: list[store.Record] | None = None
        self.present: set[str] = set()  # every entry's run name, monitored or not
        self.retry_at = 0.0

    def declare(self, entries: Iterable[BeatEntry]) -> None:
        """Save ``entries`` (the scheduler's whole set) and mark the others removed."""
        records: dict[str, store.Record] = {}
        present: set[str] = set()
        for entry in entries:
            if entry.task.startswith("celery."):
                continue  # celery's own housekeeping (backend_cleanup): not the user's
            # An entry this beat cannot monitor now (its task failed to import) is still
            # there: its row is not marked removed, so its missed slots are still recorded.
            present.add(task_identity(entry.task, entry.name))
            try:
                record = record_of(self.app, entry, self.declared_in)
            except Unmonitored as why:
                self._warn_once(entry, str(why))
                continue
            present.add(record.task_name)
            if record.task_name in records:
                # name= on the decorator names every entry of the task alike: one row.
                self._warn_once(
                    entry,
                    f"its runs are recorded as {record.task_name}, like entry "
                    f"{records[record.task_name].entry}'s (the task's name=): one schedule "
                    f"is kept for them; give the task no name= to tell the entries apart",
                )
                continue
            records[record.task_name] = record
        self.pending = list(records.values())
        self.present = present
        self.flush()

    def retry(self) -> None:
        """Save again what the last save could not (at most every ``RETRY_SECONDS``)."""
        if self.pending is not None and time.monotonic() >= self.retry_at:
            self.flush()

    def flush(self) -> None:
        records = self.pending
        if records is None:
            return
        try:
            now = timezone.now()
            moved = rescheduled(records)
            store.save(records, now)
            for name in moved:
                # The new schedule's slots before the edit were never due: judged from now.
                store.mark_swept(name, now)
            gone = store.mark_entries_removed(self.declared_in, self.present, now)
        except Exception:
            self.retry_at = time.monotonic() + RETRY_SECONDS
            logger.exception(
                "taskguard beat could not save its entries as schedules; trying again in %g s",
                RETRY_SECONDS,
                extra=log_fields("beat.save_failed"),
            )
            return
        self.pending = None
        for name in gone:
            logger.warning(
                "taskguard beat: schedule %s is no longer fired by a %s beat: marked removed "
                "(not swept nor judged)",
                name,
                self.declared_in,
                extra=log_fields("schedule.removed", task=name),
            )

    def _warn_once(self, entry: BeatEntry, why: str) -> None:
        if entry.name in self.warned:
            return
        self.warned.add(entry.name)
        logger.warning(
            "taskguard beat: entry %s is not monitored (no missed-slot alarm, no pause): %s",
            entry.name,
            why,
            extra=log_fields("beat.not_monitored", task=entry.task, reason=why),
        )


class RegisteringMixin:
    """Saves a beat scheduler's entries as schedules (mixed in before the scheduler)."""

    app: Any
    declared_in: str

    def taskguard_entries(self) -> list[BeatEntry]:
        """Every entry this scheduler fires (its subclass reads them)."""
        raise NotImplementedError

    def register_entries(self) -> None:
        """Save the entries now (the beat started, or its entries changed); never raises."""
        try:
            entries = self.taskguard_entries()
        except Exception:
            logger.exception(
                "taskguard beat could not read its entries to save them",
                extra=log_fields("beat.read_failed"),
            )
            return
        self._registrar().declare(entries)

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        self._registrar().retry()
        return super().tick(*args, **kwargs)  # type: ignore[misc]

    def _registrar(self) -> Registrar:
        registrar = self.__dict__.get("_taskguard_registrar")
        if registrar is None:
            registrar = self.__dict__["_taskguard_registrar"] = Registrar(
                self.app, self.declared_in
            )
        assert isinstance(registrar, Registrar)
        return registrar
