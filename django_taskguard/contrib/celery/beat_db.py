"""``TaskguardDatabaseScheduler``: django-celery-beat's scheduler, stamping slots.

Import it as ``django_taskguard.contrib.celery.TaskguardDatabaseScheduler``
(loaded lazily: django-celery-beat's models need the app registry).
"""

from __future__ import annotations

from typing import Any

from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry
from django_celery_beat.tzcrontab import TzAwareCrontab

from .beat import SlotDue, StampingMixin, aligned, slot_due, warn_timezone


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


class TaskguardDatabaseScheduler(StampingMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's ``DatabaseScheduler``, stamping slots; run any number of them.

    Each message also keeps django-celery-beat's ``periodic_task_name`` header;
    the periodic task's name is part of the run's identity.
    """

    Entry = TaskguardModelEntry

    def setup_schedule(self) -> None:
        super().setup_schedule()
        warn_timezone(self.app)
