"""``TaskguardDatabaseScheduler``: django-celery-beat's scheduler, stamping slots.

Import it as ``django_taskguard.contrib.celery.TaskguardDatabaseScheduler``
(loaded lazily: django-celery-beat's models need the app registry).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry
from django_celery_beat.tzcrontab import TzAwareCrontab

from ...logfields import log_fields
from .beat import SlotDue, StampingMixin, aligned, slot_due, warn_timezone
from .data_entries import DataSchedulesMixin
from .entries import DJANGO_CELERY_BEAT, BeatEntry, RegisteringMixin

logger = logging.getLogger("taskguard.celery")


class SlotTzCrontab(SlotDue, TzAwareCrontab):  # type: ignore[misc]
    """django-celery-beat's crontab with its own zone, due once per taskguard slot."""


def aligned_db(schedule: Any) -> Any:
    """:func:`.beat.aligned`, and a django-celery-beat crontab due once per taskguard slot."""
    if type(schedule) is TzAwareCrontab:
        return slot_due(schedule, SlotTzCrontab)
    return aligned(schedule)


class TaskguardModelEntry(ModelEntry):  # type: ignore[misc]
    """A periodic task row whose interval is epoch-aligned."""

    schedule: Any

    def __init__(self, model: Any, app: Any = None) -> None:
        super().__init__(model, app=app)
        self.schedule = aligned_db(self.schedule)


class TaskguardDatabaseScheduler(
    DataSchedulesMixin,
    RegisteringMixin,
    StampingMixin,
    DatabaseScheduler,  # type: ignore[misc]
):
    """django-celery-beat's ``DatabaseScheduler``, stamping slots; run any number of them.

    Each message also keeps django-celery-beat's ``periodic_task_name`` header;
    the periodic task's name is part of the run's identity. Its enabled rows are
    registered schedules (:mod:`.entries`), saved whenever it reads the rows again. It
    also fires the data schedules of Celery tasks (:mod:`.data_entries`).
    """

    Entry = TaskguardModelEntry
    declared_in = DJANGO_CELERY_BEAT

    def setup_schedule(self) -> None:
        super().setup_schedule()
        warn_timezone(self.app)
        self.refresh_data_schedules()
        self.schedule_changed_here()

    def all_as_schedule(self) -> dict[str, Any]:
        found: dict[str, Any] = super().all_as_schedule()
        self.register_entries()  # the rows changed (or were read the first time)
        found.update(self.data_entries())  # read again: keep the data schedules' entries
        self.schedule_changed_here()
        return found

    def taskguard_entries(self) -> list[BeatEntry]:
        """Every enabled row: django-celery-beat's own read leaves out the crontabs of
        hours far from now, which are no less scheduled."""
        return [entry for model in self.Model.objects.enabled() if (entry := row_entry(model))]


def row_entry(model: Any) -> BeatEntry | None:
    """A periodic task row as a :class:`.entries.BeatEntry` (None: its schedule is gone)."""
    try:
        schedule = aligned_db(model.schedule)
        headers = json.loads(model.headers or "{}")
    except Exception:
        logger.warning(
            "taskguard beat: periodic task %s cannot be read",
            model.name,
            exc_info=True,
            extra=log_fields("beat.entry_unreadable", task=model.task),
        )
        return None
    return BeatEntry(model.name, model.task, schedule, headers if isinstance(headers, dict) else {})
