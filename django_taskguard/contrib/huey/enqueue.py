"""Enqueuing side: a Huey task over a ``@once_per_schedule`` function, sent for one slot.

``@huey.task()`` goes on top, the guard under it, so that the consumer calls the guarded
function::

    @huey.task(retries=2, retry_delay=5)
    @once_per_schedule(every=timedelta(minutes=5))
    def sync(): ...

The slot travels in the task's keyword arguments (``SLOT_KWARG``, as for django.tasks):
a task sent for 12:00:00 that a consumer runs at 12:00:07 claims 12:00:00.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from huey.api import TaskWrapper

from ... import registry
from ...decorating import guarded_policy
from ...decorators import carrying_slot
from ...exceptions import TaskGuardError


def scheduled_function(value: Any) -> Any:
    """The ``@once_per_schedule`` function a Huey task wraps, or None.

    Through decorators that keep it as ``__wrapped__`` (``functools.wraps``), such as
    djhuey's ``db_task``, whose ``close_db`` wraps the function it is given.
    """
    if not isinstance(value, TaskWrapper):
        return None
    func = value.func
    while guarded_policy(getattr(func, "__wrapped__", None)) is not None:
        func = func.__wrapped__
    if guarded_policy(func) is None or not callable(getattr(func, "run_for_slot", None)):
        return None
    return func


def enqueue_for_slot(task: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> Any:
    """Send ``task`` (``@huey.task()`` over ``@once_per_schedule``) to run for ``slot``.

    ``slot`` is an aware datetime or an ISO-8601 string with an offset. It travels in the
    task's keyword arguments; the consumer's call claims it (not the slot current when
    it runs). Returns what ``Huey.enqueue`` returns (a ``Result``, or None without results).
    """
    signature = signature_for_slot(task, slot, *args, **kwargs)
    return task.huey.enqueue(signature)


def signature_for_slot(task: Any, slot: datetime | str, /, *args: Any, **kwargs: Any) -> Any:
    """The Huey task instance (``TaskWrapper.s``) that :func:`enqueue_for_slot` sends."""
    if scheduled_function(task) is None:
        raise TaskGuardError(
            f"enqueue_for_slot() takes a Huey task whose function is decorated with "
            f"@once_per_schedule (@huey.task() on top); got {task!r}"
        )
    return task.s(*args, **carrying_slot(kwargs, slot))


def _enqueue(task: Any, slot: datetime) -> str:
    signature = signature_for_slot(task, slot)
    task.huey.enqueue(signature)
    return f"huey task {signature.id} on queue {task.huey.name!r}"


def find(value: Any) -> registry.Queued | None:
    """``registry.QUEUE_FINDERS``' recogniser of Huey tasks over scheduled functions."""
    func = scheduled_function(value)
    if func is None:
        return None
    return registry.Queued(func=func, enqueue=functools.partial(_enqueue, value))
