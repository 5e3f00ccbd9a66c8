"""Celery glue: beat schedulers that stamp each message with its slot, and the
worker-side slot source that reads it.

- :mod:`.headers`: the headers, task identities and slots both sides agree on;
- :mod:`.worker`: the slot source of guarded tasks, retries, put-backs;
- :mod:`.beat`: ``TaskguardScheduler`` (``beat_schedule`` in settings);
- :mod:`.beat_db`: ``TaskguardDatabaseScheduler`` (django-celery-beat);
- :mod:`.data_entries`: data schedules of Celery tasks, sent by both schedulers;
- :mod:`.enqueue`: ``apply_once`` / ``OnceTask``, enqueue de-duplication by key;
- :mod:`.backfill`: ``manage.py backfill`` of a beat entry or a Celery data schedule, and
  a data schedule's "run now" (stamped messages).

The schedulers are loaded on first use (beat code has no place in a worker, and
django-celery-beat's models can only be imported once apps are ready), so
``CELERY_BEAT_SCHEDULER = "django_taskguard.contrib.celery:TaskguardScheduler"``
works as it is.
"""

from __future__ import annotations

from typing import Any

from . import backfill, enqueue
from .enqueue import OnceTask, apply_once
from .headers import (
    DEFERRED_HEADER,
    ENQUEUE_HEADER,
    GRACE_HEADER,
    SCHEDULE_HEADER,
    SLOT_HEADER,
    message_headers,
    slot_for,
    task_identity,
)
from .worker import celery_call_context, register

__all__ = [
    "DEFERRED_HEADER",
    "ENQUEUE_HEADER",
    "GRACE_HEADER",
    "SCHEDULE_HEADER",
    "SLOT_HEADER",
    "OnceTask",
    "TaskguardDatabaseScheduler",
    "TaskguardScheduler",
    "apply_once",
    "celery_call_context",
    "message_headers",
    "slot_for",
    "task_identity",
]

register()
enqueue.register()
backfill.register()

_LAZY = {
    "EpochInterval": "beat",
    "TaskguardEntry": "beat",
    "TaskguardScheduler": "beat",
    "StampingMixin": "beat",
    "aligned": "beat",
    "beat_claim": "beat",
    "TaskguardDatabaseScheduler": "beat_db",
    "TaskguardModelEntry": "beat_db",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module == "beat":
        from . import beat

        return getattr(beat, name)
    if module == "beat_db":
        try:
            from . import beat_db
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] != "django_celery_beat":
                raise
            raise ImportError(
                f"{name} needs django-celery-beat: "
                'pip install "django-taskguard[celery-beat]" (or use TaskguardScheduler)'
            ) from error
        return getattr(beat_db, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
