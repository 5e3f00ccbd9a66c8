"""Huey glue: Huey tasks over guarded functions, their retries, and periodic tasks that
every consumer may run.

- :mod:`.enqueue`: ``@huey.task()`` over ``@once_per_schedule``; ``run_schedules
  --enqueue`` sends each due slot to Huey with the slot in the task's keyword arguments;
- :mod:`.worker`: ``install(huey)``: the consumer's calls know their task, so Huey's
  retries are attempts of the slot's row and other copies are duplicates;
- :mod:`.periodic_tasks`: ``periodic(huey)``, in place of ``@huey.periodic_task``.

Huey's own django.tasks backend (``huey.contrib.djhuey.tasks_backend.HueyBackend``)
needs none of this: ``@task()`` over the guard goes the django.tasks way
(:mod:`django_taskguard.contrib.tasks`).
"""

from __future__ import annotations

from django.apps import apps

from ... import registry
from ...decorating import SLOT_SOURCES
from ...decorators import SLOT_KWARG
from .enqueue import enqueue_for_slot, find, scheduled_function, signature_for_slot
from .periodic_tasks import periodic
from .worker import current_task, huey_call_context, install, message_id

__all__ = [
    "SLOT_KWARG",
    "current_task",
    "enqueue_for_slot",
    "install",
    "message_id",
    "periodic",
    "register",
    "scheduled_function",
    "signature_for_slot",
]

DJHUEY = "huey.contrib.djhuey"


def register() -> None:
    """Let ``registry.discover`` find schedules that Huey tasks wrap, give guarded calls
    inside Huey tasks their message, and install djhuey's instance (idempotent)."""
    if find not in registry.QUEUE_FINDERS:
        registry.QUEUE_FINDERS.append(find)
    if huey_call_context not in SLOT_SOURCES:
        SLOT_SOURCES.append(huey_call_context)
    if apps.is_installed(DJHUEY):
        from huey.contrib.djhuey import HUEY  # imported already: it is an installed app

        install(HUEY)
